"""A structural check of an LMDB 0.9 data file, run before LMDB itself touches it.

LMDB trusts its file: a damaged B-tree page sends it past the end of the map (SIGBUS) or into an
assertion (abort), which would kill the daemon at startup or on a read. This walks every tree
(the free list, the main db, each named db) from the newest meta page, reading the file, and
checks what LMDB relies on: every page says it is the page it was reached as, branch pages above
leaves exactly ``depth`` levels deep, node offsets and sizes inside their page, keys in order,
overflow pages where values point, long enough for the value, inside the file; no page twice.
It reads one page per tree page and per big value (the open scan reads those anyway).

Layout (lmdb.h / mdb.c of LMDB 0.9, 64-bit): a page header ``pgno u64, pad u16, flags u16,
lower u16, upper u16`` (overflow pages: ``pages u32`` instead of lower/upper), node offsets
(u16) after it, nodes ``lo u16, hi u16, flags u16, ksize u16, key, data`` from ``upper`` on.
"""

from __future__ import annotations

import itertools
import mmap
import struct

_HEAD = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_DB = struct.Struct("<IHHQQQQQ")  # md_pad, md_flags, md_depth, branch, leaf, overflow pages, entries, root
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_P_INVALID = 2**64 - 1
_INTEGERKEY = 0x08
_META_DBS = 16 + 24  # offset of mm_dbs in a meta page
_MAX_PROBLEMS = 5


class _Walk:
    def __init__(self, mm: mmap.mmap | bytes, psize: int, last_pg: int) -> None:
        self.mm, self.psize, self.last_pg = mm, psize, last_pg
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

    def tree(self, root: int, depth: int, what: str, ordered: bool) -> list[tuple[bytes, int, bytes]]:
        """Walk one B-tree; returns its leaf nodes as (key, flags, data) where data is the inline
        value, the MDB_db of a named db, or the u64 overflow page number of a big value."""
        out: list[tuple[bytes, int, bytes]] = []
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
            if flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW) != want or level > depth:
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
                data = bytes(self.mm[kstart + ksize : kstart + ksize + inline])
                if nflags & _F_BIGDATA:
                    self.overflow(struct.unpack("<Q", data)[0], size, what)
                out.append((key, nflags, data))
            stack.extend((c, level + 1) for c in reversed(children))
        if ordered and any(a[0] >= b[0] for a, b in itertools.pairwise(out)):
            self.fail(f"{what}: keys are out of order")
        return out

    def overflow(self, pgno: int, size: int, what: str) -> None:
        got = self.page(pgno, what)
        if got is None:
            return
        flags, lower, upper, base = got
        pages = lower | upper << 16
        if flags & _P_OVERFLOW == 0 or pages * self.psize < size + _HEAD.size or pgno + pages - 1 > self.last_pg:
            self.fail(f"{what}: overflow page {pgno} ({pages} pages, flags {flags:#x}) cannot hold {size} bytes")


def check_btrees(data_file: str, meta: bytes, psize: int) -> list[str]:
    """Problems found in the trees the meta page ``meta`` roots (empty if sound)."""
    (last_pg,) = struct.unpack_from("<Q", meta, _META_DBS + 2 * _DB.size)
    with open(data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if (last_pg + 1) * psize > len(mm):
            return [f"pages run to {(last_pg + 1) * psize}, the file has {len(mm)} bytes"]
        walk = _Walk(mm, psize, last_pg)
        free_db, main_db = (_DB.unpack_from(meta, _META_DBS + i * _DB.size) for i in (0, 1))
        walk.tree(free_db[7], free_db[2], "free list", ordered=False)
        for name, nflags, data in walk.tree(main_db[7], main_db[2], "main db", ordered=True):
            if not nflags & _F_SUBDATA or len(data) != _DB.size:
                continue
            db = _DB.unpack(data)
            walk.tree(db[7], db[2], f"db {name.decode(errors='replace')!r}", ordered=not db[1] & _INTEGERKEY)
        return walk.problems[:_MAX_PROBLEMS]
