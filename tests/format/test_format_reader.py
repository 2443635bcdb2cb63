"""docs/FORMAT.md is enough to read kvstore's data: tests/node/read_chunk.js, a reader written from
the doc alone in plain Node.js (its own BLAKE2b, XXH3, E4M3 decoding), parses chunks, manifests,
layout ids, chunk keys and ssd records written by the Python code, and every field it prints is
compared here with what the Python code wrote. Skipped without node, unless KVSTORE_REQUIRE_NODE=1
(CI sets it), where a missing node fails instead."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
import xxhash
import zstandard

from kvstore.format import chunk, page, quant
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.layout import PRESETS, EntryFormat, get_layout
from kvstore.format.manifest import Manifest, Retention
from kvstore.tiers.base import CorruptValue
from kvstore.tiers.ssd.record import CHUNK, RUNS, ZSTD, RecordCodec
from tests.helpers.daemon import start_daemon
from tests.helpers.pages import save_page_session, scaled_block, v41_layout
from tests.helpers.store import preset_definitions
from tests.tiers.test_page_records import LAYOUTS as PAGE_LAYOUTS
from tests.tiers.test_page_records import blob_of as page_blob
from tests.tiers.test_page_records import compact as compact_codec
from tests.tiers.test_record_codec import ODD, make_chunk

ROOT_DIR = Path(__file__).resolve().parents[2]
READER = ROOT_DIR / "tests" / "node" / "read_chunk.js"
TINY = get_layout("tiny-16")


@pytest.fixture(scope="module")
def node() -> str:
    found = shutil.which("node")
    if found is None:
        if os.environ.get("KVSTORE_REQUIRE_NODE") == "1":
            pytest.fail("KVSTORE_REQUIRE_NODE=1 but node is not on PATH")
        pytest.skip("node is not on PATH")
    return found


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The presets' definitions, as FORMAT.md section 1 lists them (what the hashed JSON holds, plus the name)."""
    return preset_definitions(tmp_path_factory.mktemp("layouts") / "layouts.json")


def read(node: str, *args: object) -> Any:
    done = subprocess.run([node, str(READER), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_layout_ids(node: str, layouts: Path) -> None:
    assert read(node, "layout-ids", layouts) == {name: lay.layout_hex for name, lay in PRESETS.items()}


def check_chunk(got: dict[str, Any], blob: bytes, layout_name: str) -> None:
    lay = get_layout(layout_name)
    h = chunk.read_header(blob)
    c = chunk.decode(blob, lay)
    assert got["layout"] == layout_name
    assert got["header"] == {
        "version": h.version, "header_bytes": h.header_bytes, "total_bytes": h.total_bytes,
        "token_count": h.token_count, "start": h.start, "layout_id": h.layout_id.hex(), "key": h.key.hex(),
        "tokens_offset": h.tokens_offset, "n_sections": h.n_sections, "flags": 0,
        "compressible_offset": h.compressible_offset, "reserved": 0}
    assert [(s["cache_index"], s["kind"], s["entries"], s["offset"], s["length"]) for s in got["sections"]] == \
        chunk._sections(blob, h)
    assert got["token_ids"] == c.token_ids.tolist()
    assert got["checksum"] == f"{struct.unpack_from('<Q', blob, len(blob) - 8)[0]:016x}"
    for cache in lay.caches:
        e = c.entries[cache.name]
        assert got["caches"][cache.name] == {"codes_hex": e.codes.tobytes().hex(),
                                             "scales_hex": e.scales.tobytes().hex()}
        n = min(2, e.n)
        dequantize = quant.dequantize_main if cache.fmt is EntryFormat.FP4_E4M3_16 else quant.dequantize_indexer
        want = dequantize(torch.from_numpy(e.codes[:n].copy()), torch.from_numpy(e.scales[:n].copy()), torch.float32)
        js = np.array([[math.nan if v == "NaN" else v for v in row] for row in got["dequantized"][cache.name]],
                      np.float64).reshape(n, cache.channels)
        np.testing.assert_array_equal(js, want.numpy().astype(np.float64))  # exact: products of exact values


@pytest.mark.parametrize(("layout_name", "tokens"), [("tiny-16", 256), ("tiny-16", 3), ("tiny-16", 1),
                                                     ("deepseek-v4.1-flash", 256)])
def test_chunks_and_keys(node: str, layouts: Path, tmp_path: Path, layout_name: str, tokens: int) -> None:
    blob = make_chunk(get_layout(layout_name), tokens, seed=tokens)
    got = read(node, "chunk", write(tmp_path, "c.bin", blob), layouts, "ns", ROOT.hex())
    check_chunk(got, blob, layout_name)
    if tokens == 256:  # the key FORMAT.md section 4 derives, computed in JS over the chunk's own token ids
        ids = chunk.decode(blob, get_layout(layout_name)).token_ids
        assert got["computed_key"] == got["header"]["key"] == chunk_key(get_layout(layout_name).layout_id, "ns",
                                                                          ROOT, ids).hex()


def test_nan_scale_bytes_are_read_and_dequantize_to_nan(node: str, layouts: Path, tmp_path: Path) -> None:
    blob = bytearray(make_chunk(TINY, 256))
    first_scales = chunk.read_header(blob).compressible_offset  # main.L2's scales, entry 0, block 0
    blob[first_scales] = 0x7F
    struct.pack_into("<Q", blob, len(blob) - 8, xxhash.xxh3_64_intdigest(bytes(blob[:-8])))
    got = read(node, "chunk", write(tmp_path, "c.bin", bytes(blob)), layouts)
    check_chunk(got, bytes(blob), "tiny-16")
    assert got["dequantized"]["main.L2"][0][:16] == ["NaN"] * 16


def python_error(blob: bytes) -> str:
    try:
        chunk.decode(blob, TINY)
    except chunk.ChunkError as e:
        return type(e).__name__
    return "none"


def test_validation_order_agrees(node: str, layouts: Path, tmp_path: Path) -> None:
    blob = make_chunk(TINY, 256)
    v2 = bytearray(blob)
    v2[4] = 2
    bad_sum = bytearray(blob)
    bad_sum[-1] ^= 1
    other = bytearray(blob)
    other[24:40] = bytes(16)  # a layout neither reader knows
    struct.pack_into("<Q", other, len(other) - 8, xxhash.xxh3_64_intdigest(bytes(other[:-8])))
    def resealed(b: bytearray) -> bytes:
        struct.pack_into("<Q", b, len(b) - 8, xxhash.xxh3_64_intdigest(bytes(b[:-8])))
        return bytes(b)

    short_table = bytearray(200)  # 16 sections (a 256-byte table) in a 200-byte chunk
    struct.pack_into("<4sHHIIQ16s16sIHHII", short_table, 0, b"KVCK", 1, 336, 200, 0, 0, TINY.layout_id,
                     bytes(16), 0, 16, 0, 0, 0)
    split = chunk.read_header(blob).compressible_offset
    past_end, in_codes = bytearray(blob), bytearray(blob)
    struct.pack_into("<I", past_end, 64, len(blob) + 100)
    struct.pack_into("<I", in_codes, 64, split - 16)
    overlap = bytearray(blob)
    overlap[80:84] = blob[96:100]  # main.L2's codes moved onto index.L2's
    cases = {"3 bytes": blob[:3], "79 bytes": blob[:79], "80 zero bytes": bytes(80),
             "bad magic, short": b"XXXX" + blob[4:79],
             "version 2": bytes(v2), "cut": blob[:-1], "extended": blob + b"\0", "checksum": bytes(bad_sum),
             "other layout": bytes(other), "table past total_bytes": resealed(short_table),
             "compressible_offset past the end": resealed(past_end),
             "compressible_offset inside the codes": resealed(in_codes), "overlapping sections": resealed(overlap)}
    want = {"3 bytes": "TruncatedChunk", "79 bytes": "TruncatedChunk", "80 zero bytes": "BadMagic",
            "bad magic, short": "TruncatedChunk", "version 2": "UnsupportedVersion", "cut": "TruncatedChunk",
            "extended": "OversizedChunk", "checksum": "ChecksumMismatch", "other layout": "LayoutMismatch",
            "table past total_bytes": "MalformedChunk", "compressible_offset past the end": "MalformedChunk",
            "compressible_offset inside the codes": "MalformedChunk", "overlapping sections": "MalformedChunk"}
    for name, data in cases.items():
        got = read(node, "chunk", write(tmp_path, "c.bin", data), layouts).get("error", "none")
        assert (name, got) == (name, python_error(data)) == (name, want[name])


def test_manifest(node: str, layouts: Path, tmp_path: Path) -> None:
    tail = make_chunk(TINY, 0)  # 0 trailing tokens: every section of the tail is empty
    keys = (bytes(range(16)), bytes(range(16, 32)))
    m = Manifest("sess-1", "ns.a", TINY.layout_id, 512, 256, keys, tail, tuple(range(1000, 1128)), 1.5, 2.25,
                 Retention(False, 3600.0), {"model": "tiny", "ü": "x"}, generation=1_764_000_000_123_456)
    tail_m = Manifest("sess-2", "ns", TINY.layout_id, 3, 256, (), make_chunk(TINY, 3), (1, 2, 3), 0.0, 0.0)
    for man in (m, tail_m):
        got = read(node, "manifest", write(tmp_path, "m.bin", man.encode()), layouts)
        assert got["meta"] == {
            "session_id": man.session_id, "namespace": man.namespace, "layout_id": man.layout_id.hex(),
            "token_count": man.token_count, "chunk_tokens": man.chunk_tokens,
            "chunk_keys": [k.hex() for k in man.chunk_keys], "last_token_ids": list(man.last_token_ids),
            "created_at": man.created_at, "updated_at": man.updated_at,
            "retention": {"pinned": man.retention.pinned, "ttl_s": man.retention.ttl_s}, "metadata": man.metadata,
            "generation": man.generation}
        assert got["tail_len"] == len(man.tail)
        check_chunk(got["tail"], man.tail, "tiny-16")
        assert Manifest.decode(man.encode()) == man


@pytest.mark.parametrize(("layout_name", "tokens"), [("tiny-16", 256), ("tiny-16", 255), ("odd", 255),
                                                     ("deepseek-v4.1-flash", 256)])
def test_ssd_record(node: str, tmp_path: Path, layout_name: str, tokens: int) -> None:
    """Padding inside the tail (tiny-16, 255 tokens) and inside the codes region (odd: 24-byte codes rows)."""
    blob = make_chunk(ODD if layout_name == "odd" else get_layout(layout_name), tokens, seed=1)
    record = RecordCodec(1, chunk.compressible_offset).encode(memoryview(blob))
    assert record[0] == CHUNK
    rec_path = write(tmp_path, "r.bin", record)
    framing = read(node, "record", rec_path)
    assert (framing["flag"], framing["raw_len"]) == (CHUNK, len(blob))
    assert framing["prefix"] == chunk.read_header(blob).header_bytes
    assert record[framing["raw"][0] : framing["raw"][0] + framing["raw"][1]] == blob[: framing["prefix"]]
    frames = tmp_path / "frames"
    frames.mkdir()
    last = framing["frames"][-1]
    assert last[0] + last[1] == len(record)  # the frames the JS reader found end where the record does
    for i, (at, n) in enumerate(framing["frames"]):  # any zstd decompresses them: Python's here
        (frames / f"frame-{i}.bin").write_bytes(zstandard.ZstdDecompressor().decompress(record[at : at + n]))
    out = tmp_path / "joined.bin"
    assert read(node, "record-join", rec_path, frames, out) == {"written": len(blob)}
    assert out.read_bytes() == blob


def test_the_worked_example_in_format_md_is_what_the_writer_writes() -> None:
    done = subprocess.run([sys.executable, str(ROOT_DIR / "docs" / "format_example.py"), "--check"], timeout=120)
    assert done.returncode == 0, "docs/FORMAT.md's worked example is stale: run python docs/format_example.py"


def test_turn_records(node: str, layouts: Path, tmp_path: Path) -> None:
    """FORMAT.md section 3, "Turns": the JS reader applies a session's turn records as kvstore's ``apply``
    does: while each extends the version so far, stopping at a stale one or a damaged one."""
    from kvstore.format.turn_record import TurnRecord, apply

    spec = importlib.util.spec_from_file_location("format_example", ROOT_DIR / "docs" / "format_example.py")
    assert spec is not None and spec.loader is not None
    fx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fx)
    base, recs = fx.turn_example(tmp_path)  # records 0 and 1 extend the base, record 2 does not
    one = read(node, "turn-record", write(tmp_path, "t0.bin", recs[0].encode()))
    assert (one["base"], one["generation"], one["first_chunk"], one["chunk_keys"], one["token_count"],
            one["updated_at"], one["last_token_ids"], one["tail"]) == \
        (str(recs[0].base), str(recs[0].generation), recs[0].first_chunk, [k.hex() for k in recs[0].chunk_keys],
         recs[0].token_count, recs[0].updated_at, list(recs[0].last_token_ids), recs[0].tail.hex())
    damaged = bytearray(recs[1].encode())
    damaged[60] ^= 1  # a chunk key's byte: the checksum no longer matches
    mismatched = recs[1].encode()[:-8] + b"\0" * 8
    cases: dict[str, list[bytes]] = {
        "base alone": [], "two turns": [r.encode() for r in recs[:2]],
        "two turns, then a stale one": [r.encode() for r in recs],
        "a damaged one stops it": [recs[0].encode(), bytes(damaged), recs[1].encode()],
        "a bad checksum": [recs[0].encode(), mismatched]}
    for name, blobs in cases.items():
        files = [write(tmp_path, "m.bin", base.encode())] + [write(tmp_path, f"t{i}.bin", b)
                                                              for i, b in enumerate(blobs)]
        got = read(node, "session", layouts, *files)
        decoded = []
        for b in blobs:
            try:
                decoded.append(TurnRecord.decode(b))
            except ValueError:
                break
        want, n = apply(base, decoded)
        assert (name, got["turn_records"]) == (name, n)
        assert got["meta"]["chunk_keys"] == [k.hex() for k in want.chunk_keys], name
        assert (got["meta"]["token_count"], got["meta"]["generation"], got["meta"]["last_token_ids"],
                got["meta"]["updated_at"]) == (want.token_count, want.generation, list(want.last_token_ids),
                                               want.updated_at), name
        check_chunk(got["tail"], want.tail, "tiny-8")
    assert (fx.apply_turns(fx.read_manifest(base.encode()), cases["a damaged one stops it"])[1],
            fx.apply_turns(fx.read_manifest(base.encode()), cases["two turns, then a stale one"])[1]) == (1, 2)


# ---- ssd records of page blobs: flag 3 (FORMAT.md section 5, "Flag 3") ---------------------------

def node_join(node: str, tmp_path: Path, record: bytes) -> bytes:
    """The value the Node reader makes of ``record``: its framing (the frames' declared sizes checked against
    Python's zstandard), the frames decompressed here (Node 20 has no zstd), then ``record-join``."""
    rec_path = write(tmp_path, "r.bin", record)
    framing = read(node, "record", rec_path)
    assert "error" not in framing, framing
    assert (framing["flag"], framing["raw_len"], framing["prefix"]) == struct.unpack_from("<BII", record)
    frames = tmp_path / "frames"
    shutil.rmtree(frames, ignore_errors=True)
    frames.mkdir()
    for i, (at, n) in enumerate(framing.get("frames", [])):
        assert framing["declared"][i] == zstandard.frame_content_size(record[at : at + n])
        (frames / f"frame-{i}.bin").write_bytes(zstandard.ZstdDecompressor().decompress(record[at : at + n]))
    if framing["frames"]:
        assert framing["frames"][-1][0] + framing["frames"][-1][1] == len(record)  # the last frame ends the record
    out = tmp_path / "joined.bin"
    got = read(node, "record-join", rec_path, frames, out)
    assert got == {"written": framing["raw_len"]}, got
    return out.read_bytes()


@pytest.mark.parametrize("name", sorted(PAGE_LAYOUTS))
def test_flag_3_records_of_every_page_layout(node: str, tmp_path: Path, name: str) -> None:
    """SGLang's split pages (a pool's layers merged into one run) and vLLM's interleaved ones (one run of a
    record's scales per record), every group, through the ssd tier's codec with compact records."""
    lay = PAGE_LAYOUTS[name]
    flags = []
    for g in lay.groups:
        blob = page_blob(lay, g.group, 7)
        record = compact_codec(lay).encode(memoryview(blob))
        runs = page.scale_runs(g, page.read_header(blob).header_bytes)  # none: a group of one split page
        flags.append(record[0])
        assert record[0] == (RUNS if runs else ZSTD)
        framing = read(node, "record", write(tmp_path, "r.bin", record))
        if runs:
            assert [tuple(r) for r in framing["runs"]] == [tuple(r) for r in runs]
        assert node_join(node, tmp_path, record) == blob
    assert RUNS in flags


def test_flag_3_records_a_compact_daemon_wrote(node: str, tmp_path: Path) -> None:
    """A real daemon (``--ssd-compact-records``) saves a page session; the Node reader reads each blob's
    record straight from the LMDB data directory, byte-identical to what was saved."""
    lay = v41_layout()
    d = start_daemon(tmp_path / "data", "--ssd-compact-records")
    try:
        keys, blobs = save_page_session(d.address, lay, "pages", [scaled_block(lay, i % 2, i) for i in range(4)])
    finally:
        assert d.stop() == 0
    with lmdb.open(str(tmp_path / "data" / "ssd"), readonly=True, max_dbs=8, lock=False) as env, \
            env.begin() as txn:
        db = env.open_db(b"chunks", txn=txn, create=False)
        records = [txn.get(k, db=db) for k in keys]
    assert all(r is not None and r[0] == RUNS for r in records)
    for rec, blob in zip(records, blobs):
        assert node_join(node, tmp_path, bytes(rec)) == blob


def test_damaged_flag_3_records_are_refused_as_the_codec_refuses_them(node: str, tmp_path: Path) -> None:
    """FORMAT.md's "Reading a flag 3 record", case by case: the Node reader refuses (CorruptValue) exactly
    the records kvstore's codec refuses, before any byte is decompressed."""
    lay = PAGE_LAYOUTS["vllm-nvfp4"]
    blob = page_blob(lay, 0, 1)  # two runs: the interleaved main pages' scales, the first split index pages'
    record = compact_codec(lay).encode(memoryview(blob))
    assert record[0] == RUNS
    _, raw_len, prefix = struct.unpack_from("<BII", record)
    (g,) = struct.unpack_from("<H", record, 9)
    runs = [struct.unpack_from("<IIII", record, 11 + 16 * i) for i in range(g)]
    gathered = sum(r[1] * r[3] for r in runs)
    assert g >= 2

    def edit(fmt: str, at: int, *values: int) -> bytes:
        b = bytearray(record)
        struct.pack_into(fmt, b, at, *values)
        return bytes(b)

    o0, o1 = 11, 11 + 16
    cases = {
        "as written": record,
        "no runs": edit("<H", 9, 0),
        "a run of length 0": edit("<I", o0 + 4, 0),
        "a run of count 0": edit("<I", o0 + 12, 0),
        "stride under length": edit("<I", o0 + 8, runs[0][1] - 1),
        "runs out of order": edit("<I", o1, runs[0][0]),
        "a run past the prefix": edit("<I", 5, runs[-1][0] + (runs[-1][3] - 1) * runs[-1][2] + runs[-1][1] - 1),
        "prefix past raw_len": edit("<I", 5, raw_len + 1),
        "runs table cut": record[: 11 + 16 * g - 1],
        "raw part cut": record[: 11 + 16 * g + prefix - gathered - 1],
        "raw_len off by one": edit("<I", 1, raw_len + 1),  # the frame's declared size no longer matches
        "frame damaged": record[: 11 + 16 * g + prefix - gathered] + b"\0" * 8,
        "flag 7": edit("<B", 0, 7),
    }
    codec = RecordCodec(0, None, False)
    for name, rec in cases.items():
        try:
            py = "ok" if bytes(codec.decode(b"k", rec)) == blob else "wrong"
        except CorruptValue:
            py = "CorruptValue"
        js = read(node, "record", write(tmp_path, "r.bin", rec)).get("error", "ok")
        assert (name, js) == (name, py) == (name, "ok" if name == "as written" else "CorruptValue")
