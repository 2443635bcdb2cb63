"""A structural check of an LMDB 0.9 data file (meta pages and every B-tree), run before LMDB
itself touches it.

LMDB trusts its file: a damaged B-tree page sends it past the end of the map (SIGBUS) or into an
assertion (abort), which would kill the daemon at startup or on a read. This walks every tree
(the free list, the main db, each named db) from the newest meta page, reading the file, and
checks what LMDB relies on: every page says it is the page it was reached as, branch pages above
leaves exactly ``depth`` levels deep, node offsets and sizes inside their page, keys in order,
overflow pages where values point, long enough for the value, inside the file; no page twice.
It reads one page per tree page and per big value (the open scan reads those anyway), with the
kernel's readahead off.

Layout (lmdb.h / mdb.c of LMDB 0.9, 64-bit): a page header ``pgno u64, pad u16, flags u16,
lower u16, upper u16`` (overflow pages: ``pages u32`` instead of lower/upper), node offsets
(u16) after it, nodes ``lo u16, hi u16, flags u16, ksize u16, key, data`` from ``upper`` on.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
from dataclasses import dataclass, field

_HEAD = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize
_DB = struct.Struct("<IHHQQQQQ")  # md_pad (psize in the free db), md_flags, md_depth, pages x3, entries, md_root
_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_MAGIC, _DATA_VERSION, _P_INVALID = 0xBEEFC0DE, 1, 2**64 - 1
_INTEGERKEY = 0x08  # the free db's flags; the main db has none here
_MAX_DEPTH = 32  # LMDB's cursor stack: no B-tree is deeper
_META_DBS = _HEAD.size + _META.size  # offset of mm_dbs in a meta page
_MAX_PROBLEMS = 5

#: A leaf record: key, and the value inline (bytes) or as (overflow page number, size).
Record = tuple[bytes, bytes | tuple[int, int]]


@dataclass(frozen=True)
class Meta:
    """The parts of a meta page the checks use."""

    pgno: int
    psize: int
    last_pg: int
    txnid: int
    free_db: tuple[int, ...]
    main_db: tuple[int, ...]


@dataclass
class Inspection:
    """What the check found: problems (none: the file is sound), and the meta page a salvage can
    start from (None: no sound meta page, nothing to salvage from)."""

    data_file: str
    problems: list[str] = field(default_factory=list)
    meta: Meta | None = None
    #: For a sound file, asked for with ``head_bytes``: per named db, each key's value size and its
    #: first ``head_bytes`` bytes (what an open needs of each record, without reading any more of it).
    heads: dict[bytes, dict[bytes, tuple[int, bytes]]] = field(default_factory=dict)


class _Walk:
    def __init__(self, mm: mmap.mmap | bytes, psize: int, last_pg: int) -> None:
        # pages past the end of a truncated file count as outside, like pages past last_pg
        self.mm, self.psize, self.last_pg = mm, psize, min(last_pg, len(mm) // psize - 1)
        self.seen: set[int] = set()
        self.problems: list[str] = []

    def fail(self, msg: str) -> None:
        self.problems.append(msg)

    def page(self, pgno: int, what: str) -> tuple[int, int, int, int] | None:
        """(flags, lower, upper, base) of a page reached as ``pgno``, or None if it is not that page."""
        if not 2 <= pgno <= self.last_pg:
            self.fail(f"{what}: page {pgno} is outside pages 2..{self.last_pg}")
            return None
        if pgno in self.seen:
            self.fail(f"{what}: page {pgno} is reached twice")
            return None
        self.seen.add(pgno)
        base = pgno * self.psize
        own, _pad, flags, lower, upper = _HEAD.unpack_from(self.mm, base)
        if own != pgno:
            self.fail(f"{what}: page {pgno} says it is page {own}")
            return None
        return flags, lower, upper, base

    def nodes(self, pgno: int, base: int, lower: int, upper: int, what: str) -> list[int] | None:
        if not (_HEAD.size <= lower <= upper <= self.psize and (lower - _HEAD.size) % 2 == 0
                and lower > _HEAD.size):
            self.fail(f"{what}: page {pgno} has bad bounds lower={lower} upper={upper}")
            return None
        n = (lower - _HEAD.size) // 2
        offs = list(struct.unpack_from(f"<{n}H", self.mm, base + _HEAD.size))
        if any(not upper <= o <= self.psize - _NODE.size for o in offs):
            self.fail(f"{what}: page {pgno} has a node outside its page")
            return None
        return offs

    def tree(self, root: int, depth: int, what: str,
             ordered: bool) -> list[tuple[bytes, int, bytes | tuple[int, int]]]:
        """Walk one B-tree; returns its sound leaf nodes as (key, flags, data): data is the inline
        value (or the MDB_db of a named db), or (overflow page, size) of a big value."""
        out: list[tuple[bytes, int, bytes | tuple[int, int]]] = []
        if root == _P_INVALID:
            if depth:
                self.fail(f"{what}: empty tree of depth {depth}")
            return out
        stack = [(root, 1)]
        while stack and len(self.problems) < _MAX_PROBLEMS:
            pgno, level = stack.pop()
            got = self.page(pgno, what)
            if got is None:
                continue
            flags, lower, upper, base = got
            want = _P_LEAF if level == depth else _P_BRANCH
            if flags != want or level > depth:  # on disk, no other flag is ever set (P_DIRTY is cleared)
                self.fail(f"{what}: page {pgno} at level {level} of {depth} has flags {flags:#x}")
                continue
            offs = self.nodes(pgno, base, lower, upper, what)
            if offs is None:
                continue
            children = []
            for o in offs:
                lo, hi, nflags, ksize = _NODE.unpack_from(self.mm, base + o)
                kstart = base + o + _NODE.size
                if o + _NODE.size + ksize > self.psize:
                    self.fail(f"{what}: page {pgno} has a key running past its page")
                    break
                key = bytes(self.mm[kstart : kstart + ksize])
                if want == _P_BRANCH:
                    children.append(lo | hi << 16 | nflags << 32)
                    continue
                size = lo | hi << 16
                inline = 8 if nflags & _F_BIGDATA else size
                if o + _NODE.size + ksize + inline > self.psize:
                    self.fail(f"{what}: page {pgno} has a value running past its page")
                    break
                raw = bytes(self.mm[kstart + ksize : kstart + ksize + inline])
                data: bytes | tuple[int, int] = raw
                if nflags & _F_BIGDATA:
                    pg = struct.unpack("<Q", raw)[0]
                    if not self.overflow(pg, size, what):
                        continue
                    data = (pg, size)
                out.append((key, nflags, data))
            stack.extend((c, level + 1) for c in reversed(children))
        if ordered and any(a[0] >= b[0] for a, b in itertools.pairwise(out)):
            self.fail(f"{what}: keys are out of order")
        return out

    def overflow(self, pgno: int, size: int, what: str) -> bool:
        got = self.page(pgno, what)
        if got is None:
            return False
        flags, lower, upper, base = got
        pages = lower | upper << 16
        if flags != _P_OVERFLOW or pages * self.psize < size + _HEAD.size or pgno + pages - 1 > self.last_pg:
            self.fail(f"{what}: overflow page {pgno} ({pages} pages, flags {flags:#x}) cannot hold {size} bytes")
            return False
        return True


def _meta(page: bytes, pgno: int) -> tuple[Meta | None, str]:
    """The meta page ``pgno`` if it can be trusted, else why not. LMDB itself checks only the magic
    and the version; a flipped root, last page or map size would send it into garbage."""
    if len(page) < _META_DBS + 2 * _DB.size + _TAIL.size:
        return None, "missing"
    head = _HEAD.unpack_from(page)
    magic, version, _addr, mapsize = _META.unpack_from(page, _HEAD.size)
    free_db, main_db = _DB.unpack_from(page, _META_DBS), _DB.unpack_from(page, _META_DBS + _DB.size)
    last_pg, txnid = _TAIL.unpack_from(page, _META_DBS + 2 * _DB.size)
    if head[0] != pgno or not head[2] & _P_META or magic != _MAGIC or version != _DATA_VERSION:
        return None, "not an LMDB meta page (page number, flags, magic or version)"
    psize = free_db[0]
    if psize < 512 or psize & (psize - 1) or not 0 < mapsize < 1 << 50 or not 1 <= last_pg < 1 << 40:
        return None, f"implausible page size {psize}, map size {mapsize} or last page {last_pg}"
    if main_db[0]:  # md_pad: the page size in the free db's slot, always 0 in the main db's
        return None, f"main db pad {main_db[0]:#x} is damaged"
    for name, db, flags in (("free", free_db, _INTEGERKEY), ("main", main_db, 0)):
        root, depth = db[7], db[2]
        if db[1] != flags or depth > _MAX_DEPTH or (root == _P_INVALID) != (depth == 0):
            return None, f"{name} db flags {db[1]:#x} / depth {depth} are damaged"
        if root != _P_INVALID and not 2 <= root <= last_pg:
            return None, f"{name} db root page {root} is outside pages 2..{last_pg}"
    return Meta(pgno, psize, last_pg, txnid, free_db, main_db), ""


def _walk(mm: mmap.mmap, meta: Meta) -> tuple[list[str], dict[bytes, list[Record]]]:
    """Problems in the trees ``meta`` roots, and the sound records of every named db."""
    walk = _Walk(mm, meta.psize, meta.last_pg)
    if (meta.last_pg + 1) * meta.psize > len(mm):
        walk.fail(f"truncated: pages run to {(meta.last_pg + 1) * meta.psize}, the file has {len(mm)} bytes")
    walk.tree(meta.free_db[7], meta.free_db[2], "free list", ordered=False)
    dbs: dict[bytes, list[Record]] = {}
    for name, nflags, data in walk.tree(meta.main_db[7], meta.main_db[2], "main db", ordered=True):
        if nflags & _F_SUBDATA and isinstance(data, bytes) and len(data) == _DB.size:
            db = _DB.unpack(data)
            nodes = walk.tree(db[7], db[2], f"db {name.decode(errors='replace')!r}", ordered=not db[1] & _INTEGERKEY)
            dbs[name] = [(key, value) for key, _, value in nodes]
    return walk.problems[:_MAX_PROBLEMS], dbs


def inspect(path: str, data_name: str = "data.mdb", head_bytes: int = 0) -> Inspection | None:
    """Check the data file under ``path`` (None if there is none yet). Both meta pages must be
    sound, their transaction ids consecutive (LMDB writes them alternately: a flipped id would make
    it pick the older snapshot and silently drop the last commit), and the newer one's trees sound.
    ``head_bytes``: a sound file's ``heads`` too (read from the pages the walk read anyway; through
    LMDB a cursor's every value is read whole, py-lmdb touching each of its pages)."""
    data = os.path.join(path, data_name)
    if not os.path.exists(data) or os.path.getsize(data) == 0:
        return None  # new, or created and never written: LMDB initialises it
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        _random_access(mm)
        return _inspect(mm, data, head_bytes)


def _random_access(mm: mmap.mmap) -> None:
    """No readahead on ``mm``: the walk reads one page of each big value, and the kernel's readahead
    (often megabytes) would read the rest of every value with it, i.e. the whole file at every open."""
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)


def _inspect(mm: mmap.mmap, data: str, head_bytes: int) -> Inspection:
    out = Inspection(data)
    first = _meta(bytes(mm[:4096]), 0)[0]
    psize = first.psize if first is not None else 4096
    metas = []
    for pgno in (0, 1):
        meta, why = _meta(bytes(mm[pgno * psize : (pgno + 1) * psize]), pgno)
        if meta is None:
            out.problems.append(f"meta page {pgno}: {why}")
        else:
            metas.append(meta)
    if len(metas) == 2 and abs(metas[0].txnid - metas[1].txnid) != 1 and metas[0].txnid + metas[1].txnid:
        out.problems.append(f"transaction ids {metas[0].txnid} and {metas[1].txnid} are not consecutive")
    # Salvage from the sound meta with the soundest trees, the newer one on a tie.
    ranked = sorted(metas, key=lambda m: m.txnid, reverse=True)
    walks = [(m, *_walk(mm, m)) for m in ranked]
    walked = sorted([(m, problems) for m, problems, _ in walks], key=lambda mw: len(mw[1]))
    if walked:
        out.meta = walked[0][0]
        if ranked[0] is walked[0][0]:
            out.problems += walked[0][1]
        else:
            out.problems += [f"the newer snapshot is damaged: {p}" for p in dict(walked)[ranked[0]]]
    if head_bytes and out.meta is not None and not out.problems:  # the newest snapshot, the one LMDB opens
        out.heads = {name: {key: (_size(value), read_value(mm, out.meta.psize, value, head_bytes))
                            for key, value in records} for name, records in walks[0][2].items()}
    return out


def _size(value: bytes | tuple[int, int]) -> int:
    return len(value) if isinstance(value, bytes) else value[1]


def sound_records(data_file: str, meta: Meta) -> tuple[dict[bytes, list[Record]], list[str]]:
    """Every record reachable through sound pages from ``meta``, per named db, and the problems."""
    with open(data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        _random_access(mm)
        problems, dbs = _walk(mm, meta)
    return dbs, problems


def read_value(mm: mmap.mmap, psize: int, value: bytes | tuple[int, int], limit: int | None = None) -> bytes:
    """A record's value (its first ``limit`` bytes): inline, or from its (checked) overflow pages."""
    if isinstance(value, bytes):
        return value[:limit]
    pgno, size = value
    start = pgno * psize + _HEAD.size
    return bytes(mm[start : start + (size if limit is None else min(limit, size))])
