"""The ssd tier's record encodings (kvstore/tiers/ssd/record.py, tiers/ssd/chunk_record.py): flag 2 round-trips
every chunk bit-exact (partial spans, zero-length sections, padding inside the codes region), the
records of flags 0 and 1 written by earlier builds still read, an old data dir opens and serves,
and a damaged flag-2 record is a CorruptValue or some bytes (the store's checksum then rejects
them), never another exception."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from kvstore.format import chunk, quant
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.layout import CacheSpec, EntryFormat, Layout, get_layout
from kvstore.tiers import SsdTierConfig
from kvstore.tiers.base import CorruptValue
from kvstore.tiers.ssd import chunk_record as record_chunk
from kvstore.tiers.ssd.record import CHUNK, HEADER, RAW, ZSTD, RecordCodec, _encode_chunk
from kvstore.tiers.ssd.tier import SsdTier

#: Code widths of 24 bytes (48 channels): an odd entry count leaves padding inside the codes region.
ODD = Layout("odd", (CacheSpec("main.L2", 2, 2, 48, EntryFormat.FP4_E4M3_16),
                     CacheSpec("index.L2", 2, 2, 32, EntryFormat.FP4_UE8M0_32),
                     CacheSpec("main.L4", 4, 1, 48, EntryFormat.FP4_E4M3_16)), n_layers=6)


def make_chunk(layout: Layout, tokens: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    sigma = {c.name: torch.exp(0.5 * torch.randn(c.channels, generator=g)) for c in layout.caches}
    ents = {}
    for c in layout.caches:
        x = torch.randn(c.entries_for(tokens), c.channels, generator=g) * sigma[c.name]
        q = quant.quantize_main(x) if c.fmt is EntryFormat.FP4_E4M3_16 else quant.quantize_indexer(x)
        ents[c.name] = chunk.Entries.of(*q)
    ids = np.random.default_rng(seed).integers(0, 129_280, tokens)
    key = chunk_key(layout.layout_id, "ns", ROOT, ids) if tokens else bytes(16)
    return chunk.encode(layout, key=key, start=256, token_ids=ids, entries=ents)


CASES = [("tiny-16", 256), ("tiny-16", 0), ("tiny-16", 1), ("tiny-16", 3), ("tiny-8", 100),
         ("deepseek-v4.1-flash", 256), ("deepseek-v4.1-flash", 7), ("odd", 254), ("odd", 255)]


def layout_of(name: str) -> Layout:
    return ODD if name == "odd" else get_layout(name)


@pytest.mark.parametrize(("name", "tokens"), CASES)
def test_chunks_round_trip_bit_exact(name: str, tokens: int) -> None:
    blob = make_chunk(layout_of(name), tokens, seed=tokens)
    codec = RecordCodec(1, chunk.compressible_offset)
    record = codec.encode(memoryview(blob))
    assert bytes(codec.decode(b"k", record)) == blob
    assert HEADER.unpack_from(record)[1] == len(blob)
    if tokens >= 100:  # big enough for the frames to pay for themselves
        assert record[0] == CHUNK and len(record) < len(blob)


def test_codes_padding_and_zero_length_sections_are_planned() -> None:
    blob = make_chunk(ODD, 255)  # m=2 caches: 127 entries (127 x 24 code bytes, then 8 of padding)
    p = record_chunk.plan(blob, len(blob))
    assert p is not None and p.codes_len > sum(length for g in p.codes for _, length in g)  # padding exists
    empty = make_chunk(ODD, 1)  # the m=2 caches have no entry at all: zero-length sections
    assert record_chunk.plan(empty, len(empty)) is not None
    codec = RecordCodec(3, None)
    for b in (blob, empty):
        record = codec.encode(memoryview(b))
        assert bytes(codec.decode(b"k", record)) == b
    assert codec.encode(memoryview(blob))[0] == CHUNK
    for b in (empty, make_chunk(get_layout("tiny-16"), 0)):  # flag 2 forced although it does not pay here
        p = record_chunk.plan(b, len(b))
        assert p is not None
        forced = _encode_chunk(zstandard.ZstdCompressor(level=1), memoryview(b), p)
        assert bytes(codec.decode(b"k", forced)) == b


def test_not_a_chunk_falls_back_to_flag_1() -> None:
    fake = b"KVCK" + bytes(200_000)  # the magic, but no valid header: compressed whole (flag 1)
    codec = RecordCodec(1, None)
    record = codec.encode(memoryview(fake))
    assert record[0] == ZSTD and bytes(codec.decode(b"k", record)) == fake


def test_records_of_earlier_builds_still_read() -> None:
    blob = make_chunk(get_layout("tiny-16"), 256)
    split = chunk.compressible_offset(blob)
    flag1 = HEADER.pack(ZSTD, len(blob), split) + blob[:split] + zstandard.compress(blob[split:], 1)
    flag0 = HEADER.pack(RAW, len(blob), len(blob)) + blob
    codec = RecordCodec(1, chunk.compressible_offset)
    assert bytes(codec.decode(b"k", flag1)) == blob and bytes(codec.decode(b"k", flag0)) == blob


def test_a_data_dir_of_the_previous_encoding_opens_and_serves(tmp_path: Path) -> None:
    blobs = [make_chunk(get_layout("tiny-16"), 256, seed=s) for s in range(4)]
    keys = [bytes([s]) * 16 for s in range(4)]
    old = SsdTierConfig(path=str(tmp_path), compact_records=False)  # the previous encoder: flag 1 for chunks
    with SsdTier(old, compressible_from=chunk.compressible_offset) as tier:
        tier.put_many(zip(keys[:2], blobs[:2]))
    with SsdTier(SsdTierConfig(path=str(tmp_path)), compressible_from=chunk.compressible_offset) as tier:
        tier.put_many(zip(keys[2:], blobs[2:]))  # new records beside the old ones
        assert [bytes(v) for v in tier.get_many(keys)] == blobs  # type: ignore[arg-type]
        assert tier.stats().usage.raw_bytes == sum(map(len, blobs))


def test_damaged_chunk_records_never_raise_anything_else() -> None:
    blob = make_chunk(get_layout("tiny-16"), 256)
    codec = RecordCodec(1, chunk.compressible_offset)
    record = codec.encode(memoryview(blob))
    rng = random.Random(0)
    outcomes = {"corrupt": 0, "bytes": 0}
    for i in range(400):
        r = bytearray(record)
        if i % 4 == 0:
            r = r[: rng.randrange(len(r))]
        elif i % 4 == 1:  # the framing, the frame lengths and the chunk header + section table
            r[rng.randrange(min(len(r), 19 + 400))] ^= 1 << rng.randrange(8)
        else:
            r[rng.randrange(len(r))] ^= 1 << rng.randrange(8)
        try:
            value = codec.decode(b"k", bytes(r))
        except CorruptValue:
            outcomes["corrupt"] += 1
            continue
        outcomes["bytes"] += 1
        if bytes(value) != blob:  # bytes the framing could not tell damaged: the chunk's checksum does
            with pytest.raises(chunk.ChunkError):
                chunk.decode(bytes(value), get_layout("tiny-16"))
    assert outcomes["corrupt"] > 100
