"""The ssd tier's space: a full disk, the map limit, and a data file too short for its pages.

Why the environment is opened without ``writemap``: with it, LMDB makes the data file as large
as the map (a sparse file) and writes pages through the mapping, so on a full filesystem a write
touches a page the kernel cannot back and the process dies of SIGBUS (py-lmdb #161, documented
since py-lmdb #244). Without it LMDB writes pages with pwrite: a full disk is an error returned
by the commit (LMDB reports a short write as EIO), the transaction is aborted, the previous
version stays intact and readable. Measured here (benchmarks/bench_store.py), durable saves were
no slower without it.
"""

from __future__ import annotations

import os
import struct

import lmdb

from kvstore.tiers.base import OutOfSpace, TierError
from kvstore.tiers.lmdb_check import check_btrees

DATA_FILE = "data.mdb"
# An LMDB 0.9 meta page (lmdb.h / mdb.c, 64-bit): the page header, then MDB_meta.
_PAGE_HEAD = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize
_DB = struct.Struct("<IHHQQQQQ")  # md_pad (psize in the free db), md_flags, md_depth, pages x3, entries, md_root
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
_P_META, _MAGIC, _DATA_VERSION, _P_INVALID = 0x08, 0xBEEFC0DE, 1, 2**64 - 1
_INTEGERKEY = 0x08  # the free db's flags; the main db has none in this tier
_MAX_DEPTH = 32  # LMDB's cursor stack: no B-tree is deeper


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


def grown_map_size(path: str, current: int, needed: int, max_map_size: int) -> int:
    """The map size to grow to when a transaction of about ``needed`` bytes did not fit: double
    it (at least by ``needed``), capped at ``max_map_size`` (0: no cap). OutOfSpace at the cap."""
    want = -(-max(2 * current, current + 2 * needed) // (1 << 20)) << 20  # whole MiB
    if max_map_size:
        if current >= max_map_size:
            raise OutOfSpace(f"ssd tier: {path} is at its map limit of {max_map_size} bytes (max_map_size); a "
                             f"write of about {needed} bytes does not fit")
        want = min(want, max_map_size)
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


def _meta_problem(page: bytes, pgno: int, file_pages: int) -> str | None:
    """Why meta page ``pgno`` cannot be trusted, or None. LMDB itself checks only the magic and the
    version; a flipped root, last page or map size would send it into garbage."""
    if len(page) < _PAGE_HEAD.size + _META.size + 2 * _DB.size + _TAIL.size:
        return "missing"
    head = _PAGE_HEAD.unpack_from(page)
    magic, version, _addr, mapsize = _META.unpack_from(page, _PAGE_HEAD.size)
    off = _PAGE_HEAD.size + _META.size
    free_db, main_db = _DB.unpack_from(page, off), _DB.unpack_from(page, off + _DB.size)
    last_pg, _txnid = _TAIL.unpack_from(page, off + 2 * _DB.size)
    if head[0] != pgno or not head[2] & _P_META or magic != _MAGIC or version != _DATA_VERSION:
        return "not an LMDB meta page (page number, flags, magic or version)"
    psize = free_db[0]
    if psize < 512 or psize & (psize - 1) or not 0 < mapsize < 1 << 50:
        return f"implausible page size {psize} or map size {mapsize}"
    if last_pg >= file_pages or last_pg < 1:
        return f"last page {last_pg} is outside the {file_pages}-page file"
    for name, db, flags in (("free", free_db, _INTEGERKEY), ("main", main_db, 0)):
        root, depth = db[7], db[2]
        if db[1] != flags or depth > _MAX_DEPTH or (root == _P_INVALID) != (depth == 0):
            return f"{name} db flags {db[1]:#x} / depth {depth} are damaged"
        if root != _P_INVALID and not 2 <= root <= last_pg:
            return f"{name} db root page {root} is outside pages 2..{last_pg}"
    return None


def check_meta_pages(path: str) -> None:
    """Refuse to open a data file whose meta pages are damaged, naming the file, before LMDB
    trusts them. Both must be sound, and their transaction ids consecutive (LMDB writes them
    alternately): a flipped id would make LMDB pick the older snapshot and silently drop the last
    commit. A missing file is new, not damaged."""
    data = os.path.join(path, DATA_FILE)
    try:
        with open(data, "rb") as f:
            head = f.read(2 * 65536)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TierError(f"ssd tier: cannot read {data}: {exc}") from exc
    if not head:
        return  # created, never written: LMDB initialises it
    psize = _DB.unpack_from(head, _PAGE_HEAD.size + _META.size)[0] if len(head) >= 64 else 0
    psize = psize if psize in (4096, 8192, 16384, 32768, 65536) else 4096
    problems, txnids, pages = [], [], []
    for pgno in (0, 1):
        page = head[pgno * psize : (pgno + 1) * psize]
        why = _meta_problem(page, pgno, size // psize)
        if why is not None:
            problems.append(f"meta page {pgno}: {why}")
        else:
            txnids.append(_TAIL.unpack_from(page, _PAGE_HEAD.size + _META.size + 2 * _DB.size)[1])
            pages.append(page)
    if not problems and abs(txnids[0] - txnids[1]) != 1 and txnids != [0, 0]:
        problems.append(f"transaction ids {txnids[0]} and {txnids[1]} are not consecutive")
    if not problems:  # the trees of the meta page LMDB will use: the newer one
        problems = check_btrees(data, pages[txnids[1] > txnids[0]], psize)
    if problems:
        raise TierError(f"ssd tier: {data} is damaged ({'; '.join(problems)}): refusing to open it; restore "
                        f"the file, or move the directory away to start empty")
