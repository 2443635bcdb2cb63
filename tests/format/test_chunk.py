from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.format import chunk, quant
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.layout import get_layout

LAYOUT = get_layout("tiny-16")


def make_entries(tokens: int, seed: int = 0) -> dict[str, chunk.Entries]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for c in LAYOUT.caches:
        x = torch.randn(c.entries_for(tokens), c.channels, generator=g)
        q = quant.quantize_main(x) if c.fmt.block == 16 else quant.quantize_indexer(x)
        out[c.name] = chunk.Entries.of(*q)
    return out


def make_chunk(tokens: int = 256, seed: int = 0) -> tuple[bytes, np.ndarray, dict[str, chunk.Entries]]:
    ids = np.random.default_rng(seed).integers(0, 50_000, tokens)
    ents = make_entries(tokens, seed)
    key = chunk_key(LAYOUT.layout_id, "ns", ROOT, ids)
    return chunk.encode(LAYOUT, key=key, start=512, token_ids=ids, entries=ents), ids, ents


def test_round_trip_zero_copy() -> None:
    blob, ids, ents = make_chunk()
    assert len(blob) == chunk.encoded_size(LAYOUT, 256)
    c = chunk.decode(blob, LAYOUT)
    assert c.start == 512 and c.token_count == 256
    np.testing.assert_array_equal(c.token_ids, ids)
    for name, e in ents.items():
        np.testing.assert_array_equal(c.entries[name].codes, e.codes)
        np.testing.assert_array_equal(c.entries[name].scales, e.scales)
        assert c.entries[name].codes.base is not None  # a view on the blob, not a copy
    # the compressible tail starts at the first scales section
    assert 0 < chunk.compressible_offset(blob) < len(blob) - 256 * 4


def test_payload_matches_layout_formula() -> None:
    blob, _, _ = make_chunk(256)
    payload = LAYOUT.chunk_payload_bytes(256)
    assert payload == 256 * LAYOUT.bytes_per_token
    overhead = len(blob) - payload
    assert overhead == 256 * 4 + chunk.CHECKSUM_BYTES + chunk._pad(chunk.HEADER_BYTES + 16 * chunk.SECTION_BYTES)


@pytest.mark.parametrize("tokens", [0, 1, 3, 255])
def test_partial_spans(tokens: int) -> None:
    blob, ids, ents = make_chunk(tokens, seed=tokens)
    c = chunk.decode(blob, LAYOUT)
    assert c.token_count == tokens and c.entries["main.L2"].n == tokens // 2
    assert c.entries["main.L8"].n == tokens


def test_each_rejection_has_its_own_error() -> None:
    blob, _, _ = make_chunk()
    with pytest.raises(chunk.TruncatedChunk):
        chunk.decode(blob[:-1], LAYOUT)
    with pytest.raises(chunk.TruncatedChunk):
        chunk.decode(blob[:40], LAYOUT)
    with pytest.raises(chunk.OversizedChunk):
        chunk.decode(blob + b"\0", LAYOUT)
    with pytest.raises(chunk.BadMagic):
        chunk.decode(b"XXXX" + blob[4:], LAYOUT)
    with pytest.raises(chunk.UnsupportedVersion):
        chunk.decode(blob[:4] + struct.pack("<H", 9) + blob[6:], LAYOUT)
    with pytest.raises(chunk.LayoutMismatch):
        chunk.decode(blob, get_layout("tiny-8"))
    flipped = bytearray(blob)
    flipped[5000] ^= 0x10
    with pytest.raises(chunk.ChecksumMismatch):
        chunk.decode(bytes(flipped), LAYOUT)
    assert all(issubclass(e, chunk.ChunkError) for e in (chunk.TruncatedChunk, chunk.LayoutMismatch))


def test_encode_validates_entries() -> None:
    ents = make_entries(256)
    bad = dict(ents)
    bad["main.L2"] = chunk.Entries(ents["main.L2"].codes[:-1], ents["main.L2"].scales[:-1])
    with pytest.raises(ValueError, match=r"main.L2: codes must be uint8 \[128, 64\]"):
        chunk.encode(LAYOUT, key=bytes(16), start=0, token_ids=np.arange(256), entries=bad)
    del bad["main.L2"]
    with pytest.raises(ValueError, match="do not match layout"):
        chunk.encode(LAYOUT, key=bytes(16), start=0, token_ids=np.arange(256), entries=bad)


BLOB, _, _ = make_chunk(64, seed=3)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(BLOB) * 8 - 1))
def test_any_single_flipped_bit_is_detected(bit: int) -> None:
    b = bytearray(BLOB)
    b[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(chunk.ChunkError):
        chunk.decode(bytes(b), LAYOUT)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 600), st.integers(0, 2**40))
def test_round_trip_property(tokens: int, start: int) -> None:
    ids = np.random.default_rng(tokens).integers(0, 2**32, tokens, dtype=np.uint64)
    ents = make_entries(tokens, seed=tokens)
    blob = chunk.encode(LAYOUT, key=bytes(range(16)), start=start, token_ids=ids, entries=ents)
    c = chunk.decode(blob, LAYOUT)
    assert c.start == start and c.key == bytes(range(16))
    np.testing.assert_array_equal(c.token_ids, ids)
    for name, e in ents.items():
        np.testing.assert_array_equal(c.entries[name].codes, e.codes)
