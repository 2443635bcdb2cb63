"""Open-time repair of a damaged ssd-tier data file: keep what is sound, set the damage aside.

The tier is a cache whose every record is checked on read (chunk checksums, manifest checksums):
losing the records under a damaged page costs a re-prefill, refusing to start costs everything.
So when ``lmdb_check`` finds damage but one meta page is sound, every record reachable through
sound pages is copied into a fresh LMDB file, which then replaces the damaged one atomically (the
damaged file stays beside it as ``data.mdb.damaged-<time>`` for a post-mortem). What was lost is
logged and reported; the store finds the chunks that sessions miss at open and counts them. With
no sound meta page there is nothing to start from: the open is refused, naming the file.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import time

import lmdb

from kvstore.tiers.base import TierError
from kvstore.tiers.ssd.lmdb_check import Inspection, read_value, sound_records

log = logging.getLogger(__name__)
_BATCH_BYTES = 64 << 20


def salvage(path: str, found: Inspection, max_dbs: int) -> str:
    """Replace the damaged data file under ``path`` by a copy of its sound records; returns what
    happened, for the log and the tier's report. TierError if it cannot be done."""
    if found.meta is None:
        raise TierError(f"ssd tier: {found.data_file} is damaged ({'; '.join(found.problems)}) and has no sound "
                        f"meta page to recover from: refusing to open it; restore the file, or move the "
                        f"directory away to start empty")
    meta = found.meta
    fresh = path.rstrip("/") + ".salvage"
    shutil.rmtree(fresh, ignore_errors=True)
    kept: dict[bytes, int] = {}
    try:
        dbs, _ = sound_records(found.data_file, meta)
        size = os.path.getsize(found.data_file)
        env = lmdb.open(fresh, map_size=max(2 * size, 1 << 20), max_dbs=max_dbs, sync=True, metasync=True)
        try:
            with open(found.data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for name, records in dbs.items():
                    db = env.open_db(name)
                    kept[name] = _copy(env, db, mm, meta.psize, records)
        finally:
            env.close()
        aside = f"{found.data_file}.damaged-{int(time.time())}"
        os.link(found.data_file, aside)  # the damaged file stays, under its new name
        os.replace(os.path.join(fresh, "data.mdb"), found.data_file)  # atomic: old or new, never neither
        _fsync_dir(path)
        for stale in ("lock.mdb",):
            if os.path.exists(os.path.join(path, stale)):
                os.remove(os.path.join(path, stale))
    except (OSError, lmdb.Error) as exc:
        raise TierError(f"ssd tier: {found.data_file} is damaged ({'; '.join(found.problems)}) and could not be "
                        f"salvaged ({exc}): refusing to open it; restore the file, or move the directory "
                        f"away to start empty") from exc
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    counts = ", ".join(f"{n} {name.decode(errors='replace')!r} records" for name, n in kept.items())
    report = (f"{found.data_file} was damaged ({'; '.join(found.problems)}); kept {counts} from its sound pages "
              f"(snapshot {meta.txnid}); the damaged file is at {aside}")
    log.error("ssd tier: %s", report)
    return report


def _copy(env: lmdb.Environment, db: lmdb._Database, mm: mmap.mmap, psize: int,
          records: list[tuple[bytes, bytes | tuple[int, int]]]) -> int:
    """Write ``records`` in transactions of about 64 MB; returns how many."""
    i = 0
    while i < len(records):
        with env.begin(write=True, db=db) as txn:
            batch = 0
            while i < len(records) and batch < _BATCH_BYTES:
                key, value = records[i]
                data = read_value(mm, psize, value)
                txn.put(key, data)
                batch += len(data)
                i += 1
    return len(records)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
