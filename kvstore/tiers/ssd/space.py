"""The ssd tier's space: a full disk, the map limit, and a data file too short for its pages.

Why the environment is opened without ``writemap``: with it, LMDB makes the data file as large
as the map (a sparse file) and writes pages through the mapping, so on a full filesystem a write
touches a page the kernel cannot back and the process dies of SIGBUS (py-lmdb #161, documented
since py-lmdb #244). Without it LMDB writes pages with pwrite: a full disk is an error returned
by the commit (LMDB reports a short write as EIO), the transaction is aborted, the previous
version stays intact and readable. Measured here (benchmarks/store/bench_store.py, results/store.md),
it costs nothing: one synced transaction of a 29 MB session wrote 621 MB/s without writemap, 240
with it, and the store's durable save runs at 184 MB/s without it.
"""

from __future__ import annotations

import os

import lmdb

from kvstore.tiers.base import OutOfSpace, TierError

DATA_FILE = "data.mdb"


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def as_out_of_space(path: str, needed: int, exc: lmdb.Error) -> OutOfSpace | None:
    """``exc`` (a failed write of about ``needed`` bytes) as OutOfSpace when the disk is full,
    else None. LMDB turns a short write into EIO, so the free space decides, not the errno."""
    try:
        free = free_bytes(path)
    except OSError:
        return None
    if free >= needed and not isinstance(exc, lmdb.DiskError):
        return None
    return OutOfSpace(f"ssd tier: no space left on the filesystem of {path} for a write of about {needed} "
                      f"bytes ({free} bytes free): {exc}")


def grown_map_size(path: str, current: int, needed: int, max_map_bytes: int) -> int:
    """The map size to grow to when a transaction of about ``needed`` bytes did not fit: double
    it (at least by ``needed``), capped at ``max_map_bytes`` (0: no cap). OutOfSpace at the cap."""
    want = -(-max(2 * current, current + 2 * needed) // (1 << 20)) << 20  # whole MiB
    if max_map_bytes:
        if current >= max_map_bytes:
            raise OutOfSpace(f"ssd tier: {path} is at its map limit of {max_map_bytes} bytes (max_map_bytes); a "
                             f"write of about {needed} bytes does not fit")
        want = min(want, max_map_bytes)
    return want


def check_data_file(path: str, env: lmdb.Environment) -> None:
    """Refuse a data file shorter than the pages its meta page says are in use (a truncated copy):
    reading a page past the end of a mapped file kills the process with SIGBUS."""
    data = os.path.join(path, DATA_FILE)
    info, psize = env.info(), env.stat()["psize"]
    need = (info["last_pgno"] + 1) * psize
    size = os.stat(data).st_size
    if size < need:
        raise TierError(f"ssd tier: {data} is truncated: {size} bytes, but its pages run to {need}; refusing "
                        f"to open it (restore the file, or move the directory away to start empty)")
