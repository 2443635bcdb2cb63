"""Turn records: a session's current version stored as its manifest (the base, ``manifest.py``) and
the turns appended to it since, each a record of what it added (docs/FORMAT.md section 3, "Turns").

A turn record is written in the same transaction as the turn's chunks, under its own key, so a
turn costs what it adds on disk, not what the session holds; the store rewrites the whole manifest
and deletes the session's turn records in one transaction (a compaction) once the turns name as
many keys as the base. Binary form (little-endian):

    b"KVMT" | u16 version | u64 base | u64 generation | u64 first_chunk | u32 n_keys | u64 token_count
           | f64 updated_at | u32 n_ids | u32 tail_len | n_keys x 16-byte keys | n_ids x u32 ids | tail | xxh3-64

A reader applies a session's records in key order (``apply``) while each extends the version read
so far (``base`` its generation, ``first_chunk`` its chunk count); a record that does not is stale
or damaged, and it and every later one are ignored.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvstore.format.manifest import Manifest, ManifestError

MAGIC = b"KVMT"
VERSION = 1
PREFIX = b"t:"
_HEAD = struct.Struct("<4sHQQQIQdII")
_SEQ = 4  # bytes of a record's sequence number, big-endian: key order is turn order


def session_prefix(namespace: str, session_id: str) -> bytes:
    """The prefix of every turn record key of a session (no other session's keys start with it)."""
    return PREFIX + f"{namespace}/{session_id}".encode() + b"\0"


def turn_key(namespace: str, session_id: str, seq: int) -> bytes:
    """The meta key of a session's ``seq``-th turn record since its manifest was last written whole."""
    return session_prefix(namespace, session_id) + seq.to_bytes(_SEQ, "big")


def parse_key(key: bytes) -> tuple[str, str, int] | None:
    """(namespace, session id, seq) of a turn record key; None for another key."""
    if not key.startswith(PREFIX) or len(key) < len(PREFIX) + _SEQ + 4 or key[-_SEQ - 1] != 0:
        return None
    name = key[len(PREFIX) : -_SEQ - 1]
    ns, sep, sid = name.partition(b"/")
    if not sep or not name.isascii():
        return None
    return ns.decode(), sid.decode(), int.from_bytes(key[-_SEQ:], "big")


@dataclass(frozen=True)
class Append:
    """A turn named by what it adds (``SessionAppend`` on the wire, its namespace and layout the save
    header's): the new version is the ``base`` version's chunk keys followed by ``chunk_keys``, with
    this token count, trailing span and last ids, and the base's layout, retention and metadata."""

    namespace: str
    session_id: str
    layout_id: bytes
    base: int
    chunk_keys: tuple[bytes, ...] = field(repr=False)
    token_count: int
    tail: bytes = field(repr=False)
    last_token_ids: tuple[int, ...] = field(repr=False)


@dataclass(frozen=True)
class TurnRecord:
    """One appended turn: the version it extends and what it adds."""

    base: int  # the generation of the version it extends
    generation: int  # the generation of the version it makes
    first_chunk: int  # the chunk count of the version it extends: its keys are chunks first_chunk...
    chunk_keys: tuple[bytes, ...] = field(repr=False)
    token_count: int
    tail: bytes = field(repr=False)
    last_token_ids: tuple[int, ...] = field(repr=False)
    updated_at: float

    def encode(self) -> bytes:
        ids = np.asarray(self.last_token_ids, "<u4").tobytes()
        body = b"".join([_HEAD.pack(MAGIC, VERSION, self.base, self.generation, self.first_chunk,
                                    len(self.chunk_keys), self.token_count, self.updated_at,
                                    len(self.last_token_ids), len(self.tail)),
                         *self.chunk_keys, ids, self.tail])
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, blob: bytes | memoryview) -> TurnRecord:
        """Parse a stored turn record; ManifestError for anything that is not a whole version-1 one."""
        mv = memoryview(blob)
        if len(mv) < _HEAD.size + 8:
            raise ManifestError(f"turn record truncated ({len(mv)} bytes)")
        magic, version, base, gen, first, n_keys, tokens, updated, n_ids, tail_len = _HEAD.unpack_from(mv, 0)
        if magic != MAGIC or version != VERSION:
            raise ManifestError(f"not a version-{VERSION} turn record (magic {bytes(magic)!r}, version {version})")
        (stored,) = struct.unpack_from("<Q", mv, len(mv) - 8)
        if xxhash.xxh3_64_intdigest(mv[:-8]) != stored:
            raise ManifestError("turn record checksum mismatch")
        at = _HEAD.size
        if at + 16 * n_keys + 4 * n_ids + tail_len + 8 != len(mv):
            raise ManifestError(f"turn record of {len(mv)} bytes does not hold {n_keys} keys, {n_ids} ids and a "
                                f"{tail_len}-byte tail")
        keys = tuple(bytes(mv[at + 16 * i : at + 16 * (i + 1)]) for i in range(n_keys))
        at += 16 * n_keys
        ids = tuple(int(t) for t in np.frombuffer(mv, "<u4", n_ids, at))
        at += 4 * n_ids
        return cls(base, gen, first, keys, tokens, bytes(mv[at : at + tail_len]), ids, updated)


def apply(m: Manifest, records: Sequence[TurnRecord]) -> tuple[Manifest, int]:
    """The version ``records`` (a session's, in key order) make of its manifest ``m``, and how many of
    them it applied: each while it extends the version so far (its ``base`` that version's generation
    and its ``first_chunk`` its chunk count). ManifestError if an applied one breaks the manifest's rules."""
    keys: list[bytes] = []
    gen, count, last = m.generation, len(m.chunk_keys), None
    n = 0
    for r in records:
        if r.base != gen or r.first_chunk != count or r.generation <= gen:
            break
        keys += r.chunk_keys
        gen, count, last, n = r.generation, count + len(r.chunk_keys), r, n + 1
    if last is None:
        return m, 0
    try:
        return m.extended(keys, last.token_count, last.tail, last.last_token_ids, last.generation, last.updated_at), n
    except ValueError as e:  # InvalidArgument is a ValueError too
        raise ManifestError(f"the turn records make a manifest that breaks its rules: {e}") from None
