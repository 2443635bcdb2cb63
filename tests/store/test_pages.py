"""Engine pages in the daemon (docs/FORMAT.md, "Engine pages"): page layouts, page blobs, page
sessions, without vLLM (tests/engines/vllm_tier/ drives them from vLLM's own offloading code)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client import Client
from kvstore.engines.vllm.geometry import EngineGroup, derive
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest, Retention
from kvstore.format.page_layout import PageLayout, PageLayoutError
from tests.helpers.daemon import Daemon, free_port, start_daemon, status_of

NS = "team-a"


#: V4.1-Flash's compression ratios (the config tests/engines/vllm_tier/ runs vLLM's planner on)
RATIOS = json.loads((Path(__file__).parents[1] / "engines" / "vllm_tier" / "deepseek_v41" / "config.json").read_text())[
    "text_config"]["compress_ratios"]
#: the one prefix-cacheable group vLLM's planner makes for V4.1 (its id, its block stride) by record family
PLANNED = {"nvfp4_ds_mla": (4, 228096, "mxfp4"), "fp8_ds_mla": (2, 460224, "fp8")}


def v41_group(gid: int) -> EngineGroup:
    return EngineGroup(gid, 256, tuple(n for L in (2, 8, 14, 20) for n in (f"model.layers.{L}.attn",
                                                                          f"model.layers.{L}.attn.indexer.k_cache")))


def v41(dtype: str = "nvfp4_ds_mla", stride: int | None = None, fingerprint: dict[str, str] | None = None
        ) -> PageLayout:
    gid, planned, indexer = PLANNED[dtype]
    return derive("deepseek-ai/DeepSeek-V4.1-Flash", dtype, dtype == "nvfp4_ds_mla", [v41_group(gid)],
                  stride or planned, 1, RATIOS, fingerprint or {"tp_size": "1"}, (indexer,)).layout


LAYOUT = v41()
G = LAYOUT.groups[0].group


def block_of(group: int, seed: int, lay: PageLayout = LAYOUT) -> np.ndarray:
    """Random codes, scale bytes of a few nearby exponents (as block scales of real KV are)."""
    g = lay.group(group)
    assert g is not None
    rng = np.random.default_rng((seed, group))
    out = rng.integers(0, 256, g.block_bytes, dtype=np.uint8)
    for p in g.pages:
        recs = out[p.offset : p.offset + p.record_bytes]
        if p.arrangement == "interleaved":
            recs.reshape(p.states, p.data + p.scale)[:, p.data :] = rng.integers(0x30, 0x34, (p.states, p.scale))
        else:
            recs[p.data_bytes :] = rng.integers(0x30, 0x34, p.scale_bytes)
    return out


def blob_of(group: int, seed: int, ns: str = NS, lay: PageLayout = LAYOUT) -> tuple[bytes, bytes]:
    h = seed.to_bytes(32, "little")
    key = page.page_key(lay.layout_id, ns, group, h)
    return key, page.encode(lay, group, h, key, block_of(group, seed, lay))


# -- the layout --------------------------------------------------------------------------------------
def test_v41_geometry_is_890_bytes_per_token_in_vllms_page_order_padding_dropped() -> None:
    assert float(LAYOUT.bytes_per_token) == 890.0
    (g,) = LAYOUT.groups
    assert g.block_bytes == 227840  # the planner's 228096-byte stride less its 256 bytes of padding
    assert [p.name for p in g.pages] == ["main.L2.b0", "main.L8.b0", "main.L14.b0", "index.L2.b0", "index.L8.b0",
                                         "index.L14.b0", "main.L20.b0", "index.L20.b0"]
    assert {(p.data, p.scale, p.arrangement) for p in g.pages} == {(256, 32, "interleaved"), (64, 4, "split")}


def test_the_indexer_dtype_is_the_one_whose_pages_fill_the_stride() -> None:
    group = [v41_group(4)]
    for stride, indexer in ((228096, "mxfp4"), (269280, "fp8")):  # what the planner makes with each
        d = derive("m", "nvfp4_ds_mla", True, group, stride, 1, RATIOS, {})
        assert d.records is not None and d.records.indexer_dtype == indexer
    hopper = derive("m", "fp8_ds_mla", False, [v41_group(2)], 460224, 1, RATIOS, {})
    assert hopper.records is not None and (hopper.records.indexer_dtype, hopper.padding) == ("fp8", 0)


@pytest.mark.parametrize("stride", [100000, 4 << 20])
def test_a_block_that_does_not_match_the_geometry_is_kept_whole_as_one_opaque_page(stride: int) -> None:
    d = derive("m", "nvfp4_ds_mla", True, [v41_group(4)], stride, 1, RATIOS, {})  # too small; room for both
    assert d.opaque and d.reason
    assert all(g.block_bytes == stride and [p.name for p in g.pages] == ["opaque"] for g in d.layout.groups)


def test_the_tiers_indexer_dtype_breaks_a_tie_the_stride_cannot() -> None:
    d = derive("m", "nvfp4_ds_mla", True, [v41_group(4)], 4 << 20, 1, RATIOS, {}, ("mxfp4",))
    assert d.records is not None and d.records.indexer_dtype == "mxfp4" and d.layout.groups[0].block_bytes == 227840


def test_the_fingerprint_is_part_of_the_id() -> None:
    other = v41(fingerprint={"tp_size": "2"})
    assert other.groups == LAYOUT.groups and other.layout_id != LAYOUT.layout_id
    assert PageLayout.from_definition(LAYOUT.definition()) == LAYOUT


@pytest.mark.parametrize("definition", [b"", b"[]", b'{"kind": "chunks"}', b'{"kind": "engine-pages"}',
                                        b"\xff" * 10, b'{"kind":"engine-pages","name":"x","engine":"e",'
                                        b'"fingerprint":{},"groups":[{"group":0,"tokens":4,"block_bytes":8,'
                                        b'"pages":[{"name":"p","offset":4,"states":2,"data":4,"scale":0,'
                                        b'"arrangement":"split","page_bytes":8}]}]}'])
def test_a_malformed_definition_is_refused_with_a_reason(definition: bytes) -> None:
    with pytest.raises(PageLayoutError):
        PageLayout.from_definition(definition)


# -- the blob ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["nvfp4_ds_mla", "fp8_ds_mla"])
def test_every_group_round_trips_bit_exact_and_the_payload_is_the_block_in_engine_order(dtype: str) -> None:
    lay = v41(dtype)
    for g in lay.groups:
        key, blob = blob_of(g.group, 3, lay=lay)
        h = page.check(blob, lay, NS)
        block = block_of(g.group, 3, lay)
        assert page.payload_span(blob) == (h.header_bytes, g.block_bytes) and h.total_bytes == len(blob)
        assert blob[h.header_bytes : h.header_bytes + g.block_bytes] == block.tobytes()  # one contiguous copy
        last = max(g.pages, key=lambda p: p.offset)  # the tail after the last code byte: the last page's scales
        assert h.compressible_offset == h.header_bytes + last.offset + last.data_bytes
        out = np.zeros(g.block_bytes, np.uint8)
        page.decode_into(blob, lay, out)
        assert (out == block).all() and bytes(page.payload(blob, key)) == block.tobytes()


def resealed(blob: bytes, at: int, value: bytes) -> bytes:
    """``blob`` with ``value`` written at ``at`` and its checksum made right again."""
    bad = bytearray(blob)
    bad[at : at + len(value)] = value
    page.seal(bad)
    return bytes(bad)


def test_a_version_1_blob_is_refused_never_misread() -> None:
    """Version 1 regrouped the block (data rows, then scale rows): read as version 2 it would put
    scale bytes where codes go. Its version is refused, whatever its checksum says."""
    key, blob = blob_of(G, 9)
    old = resealed(blob, 4, (1).to_bytes(2, "little"))
    for read in (lambda: page.check(old, LAYOUT, NS), lambda: page.check_known(old, LAYOUT, key),
                 lambda: page.payload(old, key), lambda: page.payload_span(old)):
        with pytest.raises(page.PageError, match="version 1"):
            read()


def test_payload_checks_the_key_and_the_checksum() -> None:
    key, blob = blob_of(G, 10)
    other, _ = blob_of(G, 11)
    with pytest.raises(page.PageError, match="not the"):
        page.payload(blob, other)
    bad = bytearray(blob)
    bad[200] ^= 1
    with pytest.raises(page.PageError, match="checksum"):
        page.payload(bytes(bad), key)


def test_a_blob_checks_against_its_namespace_layout_and_group() -> None:
    key, blob = blob_of(G, 4)
    with pytest.raises(page.PageError, match="does not match"):
        page.check(blob, LAYOUT, "team-b")  # another tenant's key for the same block is another key
    with pytest.raises(page.PageError, match="layout"):
        page.check(blob, v41("fp8_ds_mla"), NS)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 227840 + 128), st.integers(1, 255))
def test_any_flipped_byte_is_refused_never_served(offset: int, flip: int) -> None:
    key, blob = blob_of(G, 5)
    bad = bytearray(blob)
    offset %= len(bad)
    bad[offset] ^= flip
    with pytest.raises(page.PageError):
        page.check(bytes(bad), LAYOUT, NS)


def test_truncated_or_extended_blobs_are_refused() -> None:
    _, blob = blob_of(G, 6)
    for bad in (blob[:-1], blob + b"\0", blob[:70], b""):
        with pytest.raises(page.PageError):
            page.check(bad, LAYOUT, NS)


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "python"])
def test_a_batch_check_is_page_matches_for_every_blob_and_a_corrupted_one_is_a_miss(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pages_match`` (the daemon's load checks: one C call for the batch, GIL released) answers as
    ``page_matches`` blob by blob: a flipped payload byte, a header resealed with another group or
    block hash, another tenant's blob, a truncated blob, a missing one, a version 1 blob are misses
    among good blobs, on any thread split."""
    from kvstore.format import chunk_batch
    from kvstore.store.sessions import engine_pages as pages

    if native and (chunk_batch._chunks is None or not hasattr(chunk_batch._chunks, "check_pages")):
        pytest.skip("the C kernel is not built")
    if not native:
        monkeypatch.setattr(pages, "_chunks", None)
    made = [blob_of(G, 100 + i) for i in range(12)]
    keys = [k for k, _ in made]
    blobs: list[bytes | None] = [b for _, b in made]
    flipped = bytearray(made[1][1])
    flipped[5000] ^= 0x10
    blobs[1] = bytes(flipped)
    blobs[3] = resealed(made[3][1], page.HEADER_BYTES, b"\xff")  # another block hash, checksum right
    blobs[4] = resealed(made[4][1], 48, (G + 1).to_bytes(4, "little"))  # a group the layout lacks
    keys[5], blobs[5] = blob_of(G, 105, ns="team-b")  # another tenant's blob under its own key
    blobs[6] = made[6][1][:-1]
    blobs[7] = None
    blobs[8] = resealed(made[8][1], 4, (1).to_bytes(2, "little"))
    keys[9] = made[10][0]  # a good blob, but not the one asked for
    want = [b is not None and pages.page_matches(k, NS, LAYOUT, b) for k, b in zip(keys, blobs)]
    assert want == [True, False, True, False, False, False, False, False, False, False, True, True]
    for threads in (1, 2, 5):
        assert pages.pages_match(keys, NS, LAYOUT, blobs, threads) == want
    assert pages.pages_match([], NS, LAYOUT, [], 2) == []


# -- in the daemon -----------------------------------------------------------------------------------
@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    yield d
    d.stop()


def page_session(sid: str, keys: list[bytes], tokens: int) -> Manifest:
    return Manifest(sid, NS, LAYOUT.layout_id, tokens, 0, tuple(keys), b"", (), retention=Retention(ttl_s=3600),
                    kind=Kind.ENGINE_PAGES)


def test_pages_are_saved_as_a_turn_found_by_key_and_loaded_back_across_a_restart(tmp_path: Path) -> None:
    port = free_port()
    zstd = ("--ssd-zstd-level", "1")  # compressed scale rows (the default stores them raw)
    d = start_daemon(tmp_path / "data", "--port", str(port), *zstd)
    try:
        items = [blob_of(G, s) for s in range(3)]
        keys, blobs = [k for k, _ in items], [b for _, b in items]
        with Client(address=d.address) as c:
            assert c.register_layout(LAYOUT.definition()) == LAYOUT.layout_id
            c.save_session(page_session("agent-1", keys, 768), blobs)
            assert all(c.lookup_keys(NS, keys))
            assert c.lookup_keys("team-b", keys) == [None] * len(keys)
        assert d.stop() == 0
        d = start_daemon(tmp_path / "data", "--port", str(port), *zstd)
        with Client(address=d.address) as c:  # the layout and the session survived
            assert [bytes(b) for _, b in c.load_chunks(NS, keys)] == blobs
            assert list(c.load_chunks("team-b", keys)) == []
            s = c.stats().bytes_per_token
            assert (s.tokens, s.unique_chunks, s.formula) == (768, 3, pytest.approx(890.0))
            assert s.stored < s.raw  # at level 1 the scale rows compress (FP4 codes hardly do)
    finally:
        d.stop()


def test_bad_page_input_is_invalid_argument_and_stores_nothing(daemon: Daemon) -> None:
    with Client(address=daemon.address) as c:
        code, msg = status_of(lambda: c.register_layout(b'{"kind":"engine-pages"}'))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "page layout" in msg
        key, blob = blob_of(G, 7)
        code, msg = status_of(lambda: c.save_session(page_session("s", [key], 256), [blob]))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "unknown layout" in msg  # not registered yet
        c.register_layout(LAYOUT.definition())
        bad = bytearray(blob)
        bad[-1] ^= 1
        code, msg = status_of(lambda: c.save_session(page_session("s", [key], 256), [bytes(bad)]))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "checksum" in msg
        other_key, other = blob_of(G, 8, ns="team-b")
        code, msg = status_of(lambda: c.save_session(page_session("s", [other_key], 256), [other]))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "does not match" in msg
        code, msg = status_of(lambda: c.lookup_keys(NS, [b"short"]))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert c.list_sessions(NS) == []
