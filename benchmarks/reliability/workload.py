"""Deterministic session versions for the reliability harnesses: what was saved is recomputable.

Version ``v`` of session ``(ns, sid)`` is a pure function of ``(seed, ns, sid, v)``: a writer
saves it, and a checker rebuilds it to compare byte for byte. Versions grow one history by a chunk
at a time and every ``HISTORY`` versions start a new one (so a commit also frees chunks). Chunk 0
is a system prompt shared by every session of a namespace, so deletes and garbage collection must
keep chunks another session still uses. A chunk's bytes derive from its key alone, so two sessions
that share a key share identical bytes, as content addressing requires. Entries are random bytes
(the daemon checks framing, keys and checksums, never the numbers), so no torch is needed here.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from kvstore.format import chunk
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.layout import Layout, get_layout
from kvstore.format.manifest import Manifest

LAYOUT = "tiny-16"
CHUNK_TOKENS = 64  # tiny-16: ~14 KB chunks, several LMDB pages each
HISTORY = 4  # versions per history
VOCAB = 50_000


@dataclass(frozen=True)
class Version:
    """One complete, committable version of a session."""

    namespace: str
    session_id: str
    number: int
    keys: tuple[bytes, ...]
    blobs: tuple[bytes, ...]
    token_ids: tuple[int, ...]
    manifest: Manifest

    @property
    def layout(self) -> Layout:
        return get_layout(LAYOUT)

    def parent(self, i: int) -> bytes:
        return ROOT if i == 0 else self.keys[i - 1]


def _rng(*parts: object) -> np.random.Generator:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    return np.random.default_rng(list(np.frombuffer(digest, dtype=np.uint32)))


def _entries(layout: Layout, tokens: int, rng: np.random.Generator) -> dict[str, chunk.Entries]:
    out = {}
    for c in layout.caches:
        n = c.entries_for(tokens)
        out[c.name] = chunk.Entries(rng.integers(0, 256, (n, c.code_bytes), dtype=np.uint8),
                                    rng.integers(0, 256, (n, c.scale_bytes), dtype=np.uint8))
    return out


@functools.lru_cache(maxsize=4096)
def _chunk_blob(key: bytes, start: int, token_ids: tuple[int, ...]) -> bytes:
    lay = get_layout(LAYOUT)
    return chunk.encode(lay, key=key, start=start, token_ids=np.asarray(token_ids, dtype=np.uint32),
                        entries=_entries(lay, len(token_ids), _rng("chunk", key)))


@functools.lru_cache(maxsize=1024)
def version(seed: int, namespace: str, session_id: str, number: int) -> Version:
    """Version ``number`` of ``(namespace, session_id)``: 2..HISTORY+1 chunks and a 1..CT-1 tail."""
    lay, ct = get_layout(LAYOUT), CHUNK_TOKENS
    history, step = divmod(number, HISTORY)
    system = _rng(seed, "system", namespace).integers(0, VOCAB, ct)
    own = _rng(seed, namespace, session_id, history).integers(0, VOCAB, (HISTORY + 1) * ct)
    n_chunks = 2 + step
    tail = 1 + (number * 7) % (ct - 1)
    ids = np.concatenate([system, own])[: n_chunks * ct + tail].astype(np.uint32)
    keys = tuple(chain_keys(lay.layout_id, namespace, ids, ct))
    blobs = tuple(_chunk_blob(k, i * ct, tuple(int(t) for t in ids[i * ct : (i + 1) * ct]))
                  for i, k in enumerate(keys))
    lo = len(keys) * ct
    tail_blob = chunk.encode(lay, key=bytes(16), start=lo, token_ids=ids[lo:],
                             entries=_entries(lay, len(ids) - lo, _rng(seed, "tail", namespace, session_id, number)))
    manifest = Manifest(session_id=session_id, namespace=namespace, layout_id=lay.layout_id, token_count=len(ids),
                        chunk_tokens=ct, chunk_keys=keys, tail=tail_blob,
                        last_token_ids=tuple(int(t) for t in ids[-128:]), metadata={"v": str(number)})
    return Version(namespace, session_id, number, keys, blobs, tuple(int(t) for t in ids), manifest)


def same_manifest(got: Manifest, want: Manifest) -> bool:
    """Equal in everything the writer chose (the store stamps created_at / updated_at itself)."""
    return (got.session_id, got.namespace, got.layout_id, got.token_count, got.chunk_tokens, got.chunk_keys,
            bytes(got.tail), tuple(got.last_token_ids), dict(got.metadata)) == (
            want.session_id, want.namespace, want.layout_id, want.token_count, want.chunk_tokens, want.chunk_keys,
            want.tail, want.last_token_ids, want.metadata)
