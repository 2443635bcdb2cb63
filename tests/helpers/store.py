"""Helpers for the store tests: real chunks of a layout, sessions of them, stores in a tmp dir.

Chunk contents are a pure function of the chunk's key (the entries are Gaussian KV quantized with
the real codec, seeded by the key), so a test, a child process and a verifier all agree on what a
chunk must hold without passing data around, and equal keys always carry equal bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import zstandard

from kvstore.format import chunk
from kvstore.format.keys import ROOT, chain_keys, chunk_key, chunk_key_raw
from kvstore.format.layout import PRESETS, EntryFormat, Layout, get_layout
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.quant import quantize_indexer, quantize_main
from kvstore.store import SessionStore, StoreConfig, TieredStore
from kvstore.store.sessions.chunk_index import ChunkInfo
from kvstore.tiers import HostTierConfig, RedisTierConfig, SsdTierConfig, TierConfig, make_tier
from kvstore.tiers.base import WriteBatch
from kvstore.tiers.ssd.record import RecordCodec

TINY8 = get_layout("tiny-8")
CHUNK_TOKENS = 16  # small chunks keep the tests fast; a multiple of every m of the tiny layouts
LAST_IDS = 128  # a manifest keeps the ids of this many last tokens (for bounded replay)


def seed_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def token_stream(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic token ids: uint32 [n]."""
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


def make_entries(layout: Layout, tokens: int, seed: int) -> dict[str, chunk.Entries]:
    """Packed entries of every cache of ``layout`` for ``tokens`` tokens: N(0, 1) KV, real codec."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for c in layout.caches:
        x = torch.randn(c.entries_for(tokens), c.channels, generator=g)  # [n, channels]
        quantize = quantize_main if c.fmt is EntryFormat.FP4_E4M3_16 else quantize_indexer
        out[c.name] = chunk.Entries.of(*quantize(x))
    return out


def encode_chunk(layout: Layout, key: bytes, start: int, ids: np.ndarray, seed: int | None = None) -> bytes:
    """A chunk whose entries are seeded by ``key`` (or ``seed``)."""
    ents = make_entries(layout, len(ids), seed_of(key) if seed is None else seed)
    return chunk.encode(layout, key=key, start=start, token_ids=ids, entries=ents)


@dataclass(frozen=True)
class Session:
    """One sequence cut into chunks: what a client would send for it."""

    layout: Layout
    namespace: str
    session_id: str
    token_ids: np.ndarray = field(repr=False)
    chunk_tokens: int
    keys: tuple[bytes, ...] = field(repr=False)
    blobs: tuple[bytes, ...] = field(repr=False)
    tail: bytes = field(repr=False)

    def parent(self, i: int) -> bytes:
        return ROOT if i == 0 else self.keys[i - 1]

    def chunk_ids(self, i: int) -> np.ndarray:
        return self.token_ids[i * self.chunk_tokens : (i + 1) * self.chunk_tokens]

    def manifest(self, *, version: int | None = None, retention: Retention | None = None, now: float = 0.0,
                 metadata: dict[str, str] | None = None) -> Manifest:
        meta = dict(metadata or {})
        if version is not None:
            meta["version"] = str(version)
        return Manifest(self.session_id, self.namespace, self.layout.layout_id, len(self.token_ids),
                        self.chunk_tokens, self.keys, self.tail,
                        tuple(int(t) for t in self.token_ids[-LAST_IDS:]), now, now,
                        retention or Retention(), meta)


def build_session(namespace: str, session_id: str, token_ids: np.ndarray, *, layout: Layout = TINY8,
                  chunk_tokens: int = CHUNK_TOKENS) -> Session:
    ct = chunk_tokens
    keys = chain_keys(layout.layout_id, namespace, token_ids, ct)
    blobs = [encode_chunk(layout, k, i * ct, token_ids[i * ct : (i + 1) * ct]) for i, k in enumerate(keys)]
    start = len(keys) * ct
    tail_ids = token_ids[start:]
    # The trailing span has an all-zero key; seed its entries by what its key would be.
    tail_seed = seed_of(chunk_key(layout.layout_id, namespace, keys[-1] if keys else ROOT, tail_ids))
    tail = encode_chunk(layout, bytes(16), start, tail_ids, seed=tail_seed)
    return Session(layout, namespace, session_id, token_ids, ct, tuple(keys), tuple(blobs), tail)


def check_chunk(blob: bytes | memoryview | None, layout: Layout, key: bytes, ids: np.ndarray) -> chunk.Chunk:
    """Assert ``blob`` is the chunk ``key`` names: checksum, key, token ids and every entry."""
    assert blob is not None, f"chunk {key.hex()} missing"
    c = chunk.decode(blob, layout)
    assert c.key == key
    np.testing.assert_array_equal(c.token_ids, ids)
    want = make_entries(layout, len(ids), seed_of(key))
    for name, e in want.items():
        np.testing.assert_array_equal(c.entries[name].codes, e.codes)
        np.testing.assert_array_equal(c.entries[name].scales, e.scales)
    return c


def store_config(root: Path, *, host_capacity: int = 0, ssd_capacity: int = 0, zstd_level: int = 0,
                 write_mode: str = "through", promote_on_read: bool = True, chunk_tokens: int = CHUNK_TOKENS,
                 redis_url: str | None = None, redis_namespace: str = "kvtest") -> StoreConfig:
    """host -> ssd (under ``root/ssd``) [-> redis], with the given capacities (0 = unlimited)."""
    tiers: list[TierConfig] = [
        HostTierConfig(capacity_bytes=host_capacity, pin_memory=False),
        SsdTierConfig(path=str(root / "ssd"), capacity_bytes=ssd_capacity, zstd_level=zstd_level),
    ]
    if redis_url is not None:
        tiers.append(RedisTierConfig(url=redis_url, namespace=redis_namespace))
    return StoreConfig(tiers=tuple(tiers), write_mode=write_mode, promote_on_read=promote_on_read,
                       chunk_tokens=chunk_tokens)


def make_tiered(config: StoreConfig) -> TieredStore:
    """A TieredStore over fresh tiers, as ``open_store`` builds it but without sessions or GC."""
    tiers = []
    for tc in config.tiers:
        extra = {"compressible_from": chunk.compressible_offset} if isinstance(tc, SsdTierConfig) else {}
        tiers.append(make_tier(tc, **extra))
    return TieredStore(tiers, config)


def abandon(store: TieredStore) -> None:
    """What a crash leaves: the tiers close, but the store never flushes its not-yet-durable chunks."""
    for t in store.tiers:
        t.close()


def save(sessions: SessionStore, s: Session, *, first: int = 0, **manifest_kw: object) -> Manifest:
    """save_chunks from chunk ``first`` on, then commit: what a client does. ``now=`` sets the
    store's clock (the store, not the caller, stamps a version's times)."""
    sessions.save_chunks(s.namespace, s.layout.layout_id, s.parent(first), first, s.blobs[first:])
    if "now" not in manifest_kw:
        return sessions.commit(s.manifest(**manifest_kw))  # type: ignore[arg-type]
    now, clock = float(manifest_kw["now"]), sessions.clock  # type: ignore[arg-type]
    sessions.clock = lambda: now
    try:
        return sessions.commit(s.manifest(**manifest_kw))  # type: ignore[arg-type]
    finally:
        sessions.clock = clock


def load(sessions: SessionStore, namespace: str, keys: Sequence[bytes]) -> list[tuple[bytes, bytes | None]]:
    """Each key with its verified chunk (None: a miss), read as the gRPC stream reads a load
    (``SessionStore.windows``: a batch read per window), copied out; then the promotions behind the
    read are waited for, so that a test can say where the chunks sit afterwards."""
    def copied(start: int, values: list[bytes | memoryview | None]) -> list[tuple[bytes, bytes | None]]:
        return [(keys[start + i], None if v is None else bytes(v)) for i, v in enumerate(values)]

    out = list(sessions.windows(namespace, keys, copied))
    sessions.store.settle()
    return out


def get(store: TieredStore, key: bytes) -> bytes | None:
    """One key's verified value (checksum and the key it claims) from the fastest tier holding a
    valid copy, promoted as any read (``TieredStore.copies`` of one key)."""
    return store.copies([key])[0]


def count_puts(store: TieredStore, tier: int) -> list[bytes]:
    """Record the key of every value written into ``store.tiers[tier]``, by put_many or write
    (the list grows as writes happen)."""
    t = store.tiers[tier]
    seen: list[bytes] = []
    real_many: Callable[..., None] = t.put_many
    real_write: Callable[..., int] = t.write
    batching = [False]  # a default write calls put_many: count each value once

    def put_many(items: Iterable[tuple[bytes, object]]) -> None:
        items = list(items)
        if not batching[0]:
            seen.extend(key for key, _ in items)
        real_many(items)

    def write(batch: WriteBatch) -> int:
        seen.extend(key for key, _ in batch.puts)
        batching[0] = True
        try:
            return real_write(batch)
        finally:
            batching[0] = False

    t.write = write  # type: ignore[method-assign]
    t.put_many = put_many  # type: ignore[method-assign]
    return seen


# -- the ssd tier's record framing (kvstore/tiers/ssd/tier.py), for tests that open LMDB themselves ----
SSD_HEADER = struct.Struct("<BII")  # flag (0 raw, 1 zstd, 2 chunk), raw_len, raw prefix length


def unframe(record: bytes) -> bytes:
    """The value an ssd-tier record holds (flag 2's transform is the tier's own decoder's)."""
    flag, raw_len, prefix = SSD_HEADER.unpack_from(record)
    body = record[SSD_HEADER.size :]
    if flag == 0:
        assert len(body) == raw_len
        return body
    if flag == 2:
        return bytes(RecordCodec(0, None).decode(b"", record))
    assert flag == 1, f"unknown ssd record flag {flag}"
    value = body[:prefix] + zstandard.ZstdDecompressor().decompress(body[prefix:])
    assert len(value) == raw_len
    return value


def chunk_matches(key: bytes, info: ChunkInfo, chunk_tokens: int, blob: bytes | memoryview) -> bool:
    """What the kernel must agree with, chunk by chunk in Python (the store's per-chunk check until
    issue 28):
    checksum, header (key, layout, span), and the key recomputed from its own token ids."""
    try:
        h = chunk.read_header(blob)
        chunk.verify_checksum(blob)
    except chunk.ChunkError:
        return False
    if (h.key, h.layout_id, h.start, h.token_count) != (key, info.layout_id, info.index * chunk_tokens,
                                                        chunk_tokens):
        return False
    ids = memoryview(blob)[h.tokens_offset : h.tokens_offset + 4 * h.token_count]
    return chunk_key_raw(info.layout_id, info.namespace, info.parent, ids) == key


def preset_definitions(path: Path) -> Path:
    """The presets' definitions as FORMAT.md section 1 lists them (what the hashed JSON holds, plus the
    name), written to ``path`` as one JSON list: what the Node reader takes as its layouts."""
    out = []
    for lay in PRESETS.values():
        d = asdict(lay)
        for c in d["caches"]:
            c["fmt"] = c["fmt"].value
        out.append(d)
    path.write_text(json.dumps(out))
    return path
