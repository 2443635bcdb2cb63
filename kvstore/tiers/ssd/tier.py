"""SSD tier: values in one LMDB sub-database, each stored raw (the default: a read is a view into
the map) or zstd-compressed on its own (``zstd_level``); meta records (session manifests) in a
second one, so the two kinds never share a keyspace.

A stored record is a 9-byte header and a payload (record.py; docs/FORMAT.md byte by byte)::

    flag u8        0 = raw, 1 = zstd from ``prefix`` on, 2 = a chunk, transformed and compressed,
                   3 = runs gathered (a page blob's scale rows) and compressed with the tail
    raw_len u32    length of the original value
    prefix u32     leading bytes stored uncompressed

With compression on, flag 2 (chunks, ``compact_records``) keeps the chunk header raw and
compresses its FP4 codes and its scales in forms zstd shrinks (tiers/ssd/chunk_record.py); flag 1 (other
values, or chunks with ``compact_records`` off) compresses from ``compressible_from(value)`` on. The sizes in
the header let an open rebuild usage totals and the key set from headers alone, without
decompressing. LMDB commits are atomic and crash-safe; with ``sync`` a put that returned has been
fsynced. The tier never checks contents (the store verifies chunk checksums), only the framing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import lmdb

from kvstore.tiers.base import (
    CorruptValue,
    LmdbPages,
    MetaMap,
    Stored,
    Tier,
    TierError,
    TierStats,
    Usage,
    Value,
    Views,
    WriteBatch,
    check_key,
    check_value,
)
from kvstore.tiers.config import SsdTierConfig
from kvstore.tiers.ssd import batch as ssd_batch
from kvstore.tiers.ssd.lmdb_check import inspect
from kvstore.tiers.ssd.migrate import LegacyMeta, find_legacy_meta
from kvstore.tiers.ssd.readahead import MapAdvice
from kvstore.tiers.ssd.record import HEADER, CompressibleFrom, RecordCodec
from kvstore.tiers.ssd.resize_gate import Gate
from kvstore.tiers.ssd.runs_record import CompressibleRuns
from kvstore.tiers.ssd.salvage import salvage
from kvstore.tiers.ssd.space import DATA_FILE, as_out_of_space, check_data_file, grown_map_size

log = logging.getLogger(__name__)
DB_NAME = b"chunks"  # the values' sub-database; others may be added beside it (up to _MAX_DBS)
META_DB_NAME = b"meta"  # meta records (manifests): never in the values' keyspace
_MAX_DBS = 8
_MAX_READERS = 256  # py-lmdb uses MDB_NOTLS: one slot per open read transaction, not per thread
_SLACK = 64 * 4096  # pages a transaction writes besides its values (B-tree path, free list)

@contextlib.contextmanager
def _lmdb_errors(what: str) -> Iterator[None]:
    """LMDB failures (I/O errors, a full disk, a closed environment) surface as TierError."""
    try:
        yield
    except lmdb.Error as exc:
        raise TierError(f"ssd tier: {what}: {exc}") from exc


def _raw_length(record: bytes | memoryview) -> int:
    """A record's value length from its header; 0 for a record too short to hold one (it still
    counts: its get raises TierError, and the store deletes it)."""
    return int(HEADER.unpack_from(record)[1]) if len(record) >= HEADER.size else 0


class SsdTier(Tier):
    """An LMDB-backed, compressed, durable tier. ``capacity_bytes`` is reported, not enforced.

    Usage and LRU order live in memory, so one process owns a directory. After a reopen the LRU
    order starts as LMDB key order (hash order: effectively random) and learns from then on.
    """

    name = "ssd"
    persistent = True

    def __init__(self, config: SsdTierConfig, compressible_from: CompressibleFrom | None = None,
                 legacy_meta: LegacyMeta | None = None, compressible_runs: CompressibleRuns | None = None) -> None:
        """``compressible_runs``: the byte runs of a value (a page blob's scale rows) that a compact
        record (``compact_records``: flag 3) compresses with its tail. ``legacy_meta``: what meta
        records of the first format look like among the values; given, the open moves any it finds
        to the meta sub-database first (``tiers/ssd/migrate.py``)."""
        self._config = config
        self._codec = RecordCodec(config.record_level, compressible_from, config.compact_records, compressible_runs)
        self._write_lock = threading.Lock()  # one LMDB writer at a time; also orders _sizes updates
        self._gate = Gate()  # no transaction may be open while the map is resized
        self._scratch = ssd_batch.scratch()  # decoded records of batch reads (read_views)
        self._advice = MapAdvice(os.path.join(config.path, DATA_FILE))  # readahead for batch reads
        self._meta_lock = threading.Lock()
        self._sizes: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (stored, raw), LRU
        self._stored = self._raw = 0
        self._closed = False
        try:
            os.makedirs(config.path, exist_ok=True)
        except OSError as exc:
            raise TierError(f"ssd tier: cannot create {config.path}: {exc}") from exc
        self._salvaged = ""  # what an open-time repair of a damaged data file did (``TierStats.salvaged``)
        try:
            found = inspect(config.path, head_bytes=HEADER.size)
        except (OSError, ValueError, struct.error) as exc:  # unreadable, or beyond what the check parses
            raise TierError(f"ssd tier: cannot check {config.path}: {exc}") from exc
        if found is not None and found.problems:
            self._salvaged = salvage(config.path, found, _MAX_DBS)
        with _lmdb_errors(f"cannot open {config.path}"):
            self._env = lmdb.open(
                config.path,
                map_size=config.initial_map_size,
                max_dbs=_MAX_DBS,
                max_readers=_MAX_READERS,
                sync=config.sync,
                metasync=config.sync,
                # Never writemap: on a full disk its writes through a sparse map die of SIGBUS
                # (see tiers/ssd/space.py); pwrite returns an error instead.
                writemap=False,
                # Lookups are random (keys are hashes) and the file can outgrow RAM: reading ahead
                # would only fill the page cache with neighbours nobody asked for.
                readahead=False,
            )
            self._db = self._env.open_db(DB_NAME)
            self._meta_db = self._env.open_db(META_DB_NAME)
            try:
                check_data_file(config.path, self._env)
            except TierError:
                self._env.close()
                raise
            if found is not None and not found.problems:
                self._scan_heads(found.heads.get(DB_NAME, {}))
            else:  # new, or salvaged just now: LMDB's own view
                self._scan()
        self._meta = _LmdbMeta(self)
        if legacy_meta is not None:
            self._migrate(legacy_meta)

    def _migrate(self, legacy: LegacyMeta) -> None:
        """Move the first format's meta records out of the values, in one transaction. A failure is
        logged and the tier opens all the same (the next open tries again)."""
        try:
            with _lmdb_errors("migrate"), self._gate.shared():
                found = find_legacy_meta(self._env, self._db, self._codec.decode, legacy, self._config.path)
            self._commit("migrate", [], [key for key, _ in found], meta_puts=found)
        except TierError as e:
            log.error("cannot migrate old-format meta records in ssd tier %s: %s", self._config.path, e)
            return
        if found:
            log.warning("moved %d meta records of the old format out of ssd tier %s's values", len(found),
                        self._config.path)

    def _scan(self) -> None:
        # Headers only, no decompression: but py-lmdb touches every page of each value a cursor
        # returns, so this reads the whole file (``_scan_heads`` is the open's way; this one is for
        # a file LMDB created or a salvage rewrote just now).
        with self._env.begin(db=self._db, buffers=True) as txn:
            for key, record in txn.cursor():
                self._set(bytes(key), len(record), _raw_length(record))

    def _scan_heads(self, heads: dict[bytes, tuple[int, bytes]]) -> None:
        """The sizes from the open's check (``lmdb_check.inspect``: each record's size and header,
        from one page of it), so that opening a big store does not read all of it."""
        for key, (stored, head) in heads.items():
            self._set(key, stored, _raw_length(head))

    def _set(self, key: bytes, stored: int, raw: int) -> None:
        self._drop(key)
        self._sizes[key] = (stored, raw)
        self._stored += stored
        self._raw += raw

    def _drop(self, key: bytes) -> None:
        old = self._sizes.pop(key, None)
        if old is not None:
            self._stored -= old[0]
            self._raw -= old[1]

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("ssd tier: used after close()")

    def _commit(self, op: str, puts: Sequence[tuple[bytes, memoryview]], deletes: Iterable[bytes] = (),
                meta_puts: Sequence[tuple[bytes, bytes]] = (), meta_deletes: Sequence[bytes] = ()) -> int:
        """Write ``puts`` (values, each framed as a record on its way into the transaction) and
        ``deletes`` (and the meta records') in one transaction, doubling the map whenever it fills,
        then update the in-memory sizes. Returns how many deleted keys (of the values and the meta
        records) were present."""
        deletes = list(deletes)
        if not (puts or deletes or meta_puts or meta_deletes):
            return 0  # nothing to write: no transaction, no fsync
        needed = sum(HEADER.size + len(v) for _, v in puts) + sum(len(r) for _, r in meta_puts)
        with self._write_lock, _lmdb_errors(f"{op} failed"):
            self._check_open()
            while True:
                # The writer passes no gate: only it resizes the map, under this same lock.
                txn = self._env.begin(write=True, db=self._db)
                try:
                    stored = []
                    for key, value in puts:  # each record is put (copied by LMDB) before the next is made
                        record = self._codec.encode_one(value)
                        txn.put(key, record)
                        stored.append(len(record))
                    gone = [key for key in deletes if txn.delete(key)]
                    for key, meta in meta_puts:
                        txn.put(key, meta, db=self._meta_db)
                    meta_gone = sum(bool(txn.delete(key, db=self._meta_db)) for key in meta_deletes)
                    txn.commit()
                    break
                except lmdb.MapFullError:
                    self._abort(txn, grow_for=needed)
                except lmdb.Error as exc:
                    self._abort(txn)
                    full = as_out_of_space(self._config.path, needed + _SLACK, exc)
                    if full is not None:
                        raise full from exc
                    raise
                except BaseException:
                    self._abort(txn)
                    raise
            with self._meta_lock:
                for (key, value), n in zip(puts, stored):
                    self._set(key, n, len(value))
                for key in deletes:  # present or not: a key LMDB cannot find is gone for us too
                    self._drop(key)
            return len(gone) + meta_gone

    def _abort(self, txn: lmdb.Transaction, grow_for: int | None = None) -> None:
        # Readers are drained first: py-lmdb 3.0's abort waits until no call is in flight on the
        # environment, which a steady stream of readers can put off for minutes; and set_mapsize
        # needs no transaction open at all. (Aborting after a failed commit is a no-op.)
        with self._gate.exclusive():
            txn.abort()
            if grow_for is not None:  # OutOfSpace at the configured limit
                current = self._env.info()["map_size"]
                self._env.set_mapsize(grown_map_size(self._config.path, current, grow_for, self._config.max_map_bytes))
                self._advice.remapped()

    def _read(self, keys: Sequence[bytes]) -> list[Stored | None]:
        self._check_open()
        # buffers=True: decode straight from the memory map, making exactly one copy.
        with _lmdb_errors("get failed"), self._gate.shared(), self._env.begin(db=self._db, buffers=True) as txn:
            records = [(key, txn.get(key)) for key in keys]
            values: list[Stored | None] = [
                self._lost(key) if rec is None else self._codec.decode(key, rec) for key, rec in records
            ]
        self._touch(keys, values)
        return values

    @contextlib.contextmanager
    def read_views(self, keys: Sequence[bytes]) -> Iterator[Views]:
        """One read transaction for the batch, open for the ``with`` block: a value stored raw is a
        view into the memory map (no copy; invalid once the block ends), a compressed one is decoded.
        Writers go on meanwhile (LMDB readers see their snapshot); the map is not resized until the
        block ends, so keep it short: check and copy, then leave."""
        keys = [check_key(key) for key in keys]
        self._check_open()
        with (self._gate.shared(), self._advice.reading_ahead(len(keys)),
              self._scratch.lending() as lend):  # lent until the block ends
            with _lmdb_errors("get failed"):
                txn = self._env.begin(db=self._db, buffers=True)
            try:
                with _lmdb_errors("get failed"):
                    found = ssd_batch.views(txn, self._codec, keys, lend)
                missing = [i for i, v in enumerate(found.values) if v is None and i not in found.unreadable]
                found = found._replace(unreadable=found.unreadable | self._lost_among(keys, missing))
                self._touch(keys, found.values)
                yield found
            finally:
                txn.abort()  # a read transaction: ends the snapshot (and every view into it)

    def _lost_among(self, keys: Sequence[bytes], missing: Sequence[int]) -> frozenset[int]:
        """Those of the ``missing`` (a lookup found nothing) that the tier knows it holds (``_lost``)."""
        with self._meta_lock:
            return frozenset(i for i in missing if keys[i] in self._sizes)

    def _touch(self, keys: Sequence[bytes], found: Sequence[object]) -> None:
        with self._meta_lock:
            for key, value in zip(keys, found):
                if value is not None and key in self._sizes:
                    self._sizes.move_to_end(key)

    def _lost(self, key: bytes) -> Stored | None:
        """A key the open scan (or a write) saw, that a lookup cannot find: the B-tree is damaged
        above it (a branch page). Unreadable, not absent: the store counts and drops it."""
        with self._meta_lock:
            known = key in self._sizes
        if known:
            raise CorruptValue(f"ssd tier: key {key.hex()} is in the database but a lookup cannot find it "
                               f"(a damaged B-tree page)")
        return None  # absent

    def put_many(self, items: Iterable[tuple[bytes, Value]]) -> None:
        checked = [(check_key(key), check_value(value)) for key, value in items]
        self._commit("put_many", checked)  # one transaction: one fsync for the batch

    def write(self, batch: WriteBatch) -> int:
        puts = [(check_key(key), check_value(value)) for key, value in batch.puts]
        # values and meta records, puts and deletes, in one LMDB transaction: one commit, one fsync
        return self._commit("write", puts, [check_key(key) for key in batch.deletes],
                            meta_puts=[(check_key(key), bytes(value)) for key, value in batch.meta_puts],
                            meta_deletes=[check_key(key) for key in batch.meta_deletes])

    def get_many(self, keys: Sequence[bytes]) -> list[Stored | None]:
        return self._read([check_key(key) for key in keys])

    def delete_many(self, keys: Iterable[bytes]) -> int:
        return self._commit("delete_many", [], [check_key(key) for key in keys])

    def meta(self) -> MetaMap:
        return self._meta

    def _read_meta(self, key: bytes) -> bytes | None:
        self._check_open()
        with _lmdb_errors("meta get failed"), self._gate.shared(), self._env.begin(db=self._meta_db) as txn:
            value = txn.get(key)
        return None if value is None else bytes(value)

    def _meta_keys(self) -> list[bytes]:
        self._check_open()
        with _lmdb_errors("meta keys failed"), self._gate.shared(), self._env.begin(db=self._meta_db) as txn:
            return [bytes(key) for key in txn.cursor().iternext(keys=True, values=False)]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        keys = [check_key(key) for key in keys]
        with self._meta_lock:
            self._check_open()
            sizes = self._sizes
            return [key in sizes for key in keys]

    def size_of(self, key: bytes) -> int | None:
        check_key(key)
        with self._meta_lock:
            self._check_open()
            sizes = self._sizes.get(key)
            return None if sizes is None else sizes[0]

    def stats(self, pages: bool = False) -> TierStats:
        with self._meta_lock:
            self._check_open()
            usage = Usage(self._stored, self._config.capacity_bytes, len(self._sizes), self._raw)
        return TierStats(usage, self._pages() if pages else None, self._salvaged)

    def keys(self) -> Iterator[bytes]:
        return self.victims()

    def victims(self) -> Iterator[bytes]:
        with self._meta_lock:
            self._check_open()
            snapshot = list(self._sizes)
        return iter(snapshot)

    def _pages(self) -> LmdbPages:
        """LMDB's own page statistics for the values and meta sub-databases together."""
        self._check_open()
        with _lmdb_errors("stats failed"), self._gate.shared(), self._env.begin(db=self._db) as txn:
            stats, info = [txn.stat(self._db), txn.stat(self._meta_db)], self._env.info()
        psize = stats[0]["psize"]
        return LmdbPages(psize=psize, depth=stats[0]["depth"],
                         **{name: sum(s[name] for s in stats) for name in ("branch_pages", "leaf_pages",
                                                                            "overflow_pages", "entries")},
                         map_size=info["map_size"], last_pgno=info["last_pgno"],
                         file_bytes=(info["last_pgno"] + 1) * psize, last_txnid=info["last_txnid"])

    def flush(self) -> None:
        """Force everything written so far to disk (a no-op cost-wise with ``sync=True``)."""
        with self._write_lock:
            self._check_open()
            with _lmdb_errors("flush failed"):
                self._env.sync(True)

    def close(self) -> None:
        with self._write_lock:
            if self._closed:
                return
            with self._meta_lock:
                self._closed = True
            # Wait for readers still inside a transaction; sync covers sync=False's pending writes.
            with self._gate.exclusive(), _lmdb_errors("close failed"):
                self._env.sync(True)
                self._env.close()


class _LmdbMeta(MetaMap):
    """The ssd tier's meta sub-database: raw records, written through the tier's one writer."""

    def __init__(self, tier: SsdTier) -> None:
        self._tier = tier

    def put(self, key: bytes, value: bytes) -> None:
        self._tier._commit("meta put", [], meta_puts=[(check_key(key), bytes(value))])

    def get(self, key: bytes) -> bytes | None:
        return self._tier._read_meta(check_key(key))

    def delete(self, key: bytes) -> bool:
        return self._tier._commit("meta delete", [], meta_deletes=[check_key(key)]) == 1

    def keys(self) -> Iterator[bytes]:
        return iter(self._tier._meta_keys())
