"""A real-geometry agent session for the resume benchmarks: chunks of deepseek-v4.1-flash at the
daemon's default chunk size, Gaussian KV through the real FP4 codecs, grown by 2,048-token turns.

Quantizing 1M tokens of KV on two cores takes minutes, so ``TEMPLATES`` chunks' worth is quantized
once and their entries are reused, each chunk encoded under its own token ids, start and chained key:
every chunk is distinct (its own key, ids and checksum) and compresses as real chunks do (zstd sees
one record at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.common import chunk_session
from kvstore.format import chunk
from kvstore.format.keys import chain_keys
from kvstore.format.layout import Layout, get_layout
from kvstore.format.manifest import Manifest
from kvstore.store.config import StoreConfig

LAYOUT = "deepseek-v4.1-flash"
CHUNK_TOKENS = StoreConfig.chunk_tokens  # the daemon's default
TURN_TOKENS = 2048
TEMPLATES = 16


@dataclass(frozen=True)
class Session:
    """One session's chunks (``blobs[i]`` holds tokens [i*C, (i+1)*C), key ``keys[i]``)."""

    layout: Layout
    namespace: str
    blobs: list[bytes]
    keys: list[bytes]
    ids: np.ndarray
    chunk_tokens: int = CHUNK_TOKENS

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.blobs))

    @property
    def tokens(self) -> int:
        return len(self.keys) * self.chunk_tokens

    def turns(self, session_id: str, turn_tokens: int = TURN_TOKENS) -> list[tuple[Manifest, list[bytes]]]:
        """The session saved turn by turn: (manifest after the turn, the turn's new chunks)."""
        per = turn_tokens // self.chunk_tokens
        return [(manifest(self, session_id, end), self.blobs[end - per : end])
                for end in range(per, len(self.keys) + 1, per)]


def make_session(tokens: int, namespace: str, seed: int = 0) -> Session:
    """A session of ``tokens`` tokens (a multiple of the chunk size) under ``namespace``."""
    lay = get_layout(LAYOUT)
    n = tokens // CHUNK_TOKENS
    templates, _, _ = chunk_session(lay, namespace, min(TEMPLATES, n), CHUNK_TOKENS, seed)
    entries = [chunk.decode(b, lay).entries for b in templates]
    ids = np.random.default_rng(seed + 1).integers(0, 129_280, n * CHUNK_TOKENS)
    keys = chain_keys(lay.layout_id, namespace, ids, CHUNK_TOKENS)
    blobs = [chunk.encode(lay, key=k, start=i * CHUNK_TOKENS, token_ids=ids[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS],
                          entries=entries[i % len(entries)]) for i, k in enumerate(keys)]
    return Session(lay, namespace, blobs, keys, ids)


def manifest(s: Session, session_id: str, n_chunks: int) -> Manifest:
    """The manifest of the session's first ``n_chunks`` chunks (an empty trailing span)."""
    lay, tokens = s.layout, n_chunks * s.chunk_tokens
    empty = {c.name: chunk.Entries(np.zeros((0, c.code_bytes), np.uint8), np.zeros((0, c.scale_bytes), np.uint8))
             for c in lay.caches}
    tail = chunk.encode(lay, key=bytes(16), start=tokens, token_ids=np.zeros(0, np.uint32), entries=empty)
    return Manifest(session_id, s.namespace, lay.layout_id, tokens, s.chunk_tokens, tuple(s.keys[:n_chunks]), tail,
                    tuple(int(t) for t in s.ids[max(0, tokens - 128) : tokens]))


def label(tokens: int) -> str:
    """A session size as the reports name it: 128K, 1M."""
    return f"{tokens // 1_048_576}M" if tokens % 1_048_576 == 0 else f"{tokens // 1024}K"


def section_title(tokens: int, chunks: int, nbytes: int) -> str:
    """The heading of one session size's section in a report."""
    return f"## {label(tokens)} tokens: {chunks} chunks, {nbytes / 1e6:.0f} MB"
