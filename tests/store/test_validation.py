"""What a save must satisfy (issue 19, second pass): chunks whose every field is checked, so any
malformed blob is a ``ChunkError`` with a message (never ``struct.error``); manifests whose last
token ids and retention are what docs/FORMAT.md says. Unit checks on the codec and the pure
validators, then the same inputs through a real daemon (gRPC and the local socket share the
servicer): INVALID_ARGUMENT saying what was wrong, and nothing stored changes."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.format import chunk
from kvstore.format.keys import ROOT
from kvstore.format.layout import get_layout
from kvstore.format.manifest import Manifest, ManifestError, Retention, manifest_key
from kvstore.store import SessionStore, open_store
from tests.helpers.daemon import Daemon, make_session, running_daemon, save_session, status_of
from tests.helpers.store import CHUNK_TOKENS, TINY8, build_session, save, store_config
from tests.tiers.test_record_codec import make_chunk

TINY = get_layout("tiny-16")
_COMPRESSIBLE_AT = 64


def resealed(blob: bytes | bytearray) -> bytes:
    """``blob`` with its checksum recomputed: damage a checksum cannot see."""
    b = bytearray(blob)
    struct.pack_into("<Q", b, len(b) - 8, xxhash.xxh3_64_intdigest(bytes(b[:-8])))
    return bytes(b)


def with_u32(blob: bytes, offset: int, value: int) -> bytes:
    b = bytearray(blob)
    struct.pack_into("<I", b, offset, value)
    return resealed(b)


def table_past_the_end() -> bytes:
    """A 200-byte chunk of tiny-16 (16 sections, so a 256-byte table from offset 72) that declares
    header_bytes 336 and no tokens: every bound the old reader checked holds, its table does not fit."""
    b = bytearray(200)
    struct.pack_into("<4sHHIIQ16s16sIHHII", b, 0, chunk.MAGIC, 1, 336, 200, 0, 0, TINY.layout_id, bytes(16),
                     0, 16, 0, 0, 0)
    return resealed(b)


# -- the chunk codec ---------------------------------------------------------------------------------
def test_a_section_table_past_total_bytes_is_a_chunk_error() -> None:
    with pytest.raises(chunk.MalformedChunk, match="before header_bytes 336"):
        chunk.decode(table_past_the_end(), TINY)


@pytest.mark.parametrize(("where", "pattern"), [
    ("past the end", "compressible_offset .* is outside"),
    ("before the sections", "compressible_offset .* is outside"),
    ("inside the codes", r"codes\): bytes .* outside"),
    ("inside the scales", r"scales\): bytes .* outside"),
])
def test_compressible_offset_must_split_codes_from_scales(where: str, pattern: str) -> None:
    blob = make_chunk(TINY, 256)
    h = chunk.read_header(blob)
    value = {"past the end": h.total_bytes + 100, "before the sections": h.header_bytes - 16,
             "inside the codes": h.compressible_offset - 16, "inside the scales": h.compressible_offset + 16}[where]
    bad = with_u32(blob, _COMPRESSIBLE_AT, value)
    with pytest.raises(chunk.MalformedChunk, match=pattern):
        chunk.decode(bad, TINY)
    with pytest.raises(chunk.MalformedChunk):
        chunk.check(bad, TINY)
    assert chunk.decode(with_u32(blob, _COMPRESSIBLE_AT, h.compressible_offset), TINY).header == h


def test_a_non_canonical_table_is_checked_field_by_field() -> None:
    blob = make_chunk(TINY, 256)
    h = chunk.read_header(blob)
    sec = chunk.HEADER_BYTES  # entry 0: main.L2 codes
    # codes of main.L2 moved onto index.L2's codes: both in bounds, overlapping
    other_off = struct.unpack_from("<I", blob, sec + 16 + 8)[0]
    with pytest.raises(chunk.MalformedChunk, match="overlap"):
        chunk.decode(with_u32(blob, sec + 8, other_off), TINY)
    # codes of main.L2 moved into the header
    with pytest.raises(chunk.MalformedChunk, match="outside"):
        chunk.decode(with_u32(blob, sec + 8, 8), TINY)
    # entry 1 claims to be main.L2's codes again: a duplicate, and index.L2 lacks its codes
    b = bytearray(blob)
    struct.pack_into("<H", b, sec + 16, 0)
    with pytest.raises(chunk.MalformedChunk):
        chunk.decode(resealed(b), TINY)
    assert chunk.decode(blob, TINY).header == h


VALID = make_chunk(TINY, 3, seed=5)  # short (fast) and with non-empty sections of both kinds
VALID_HEADER = chunk.read_header(VALID).header_bytes


def decoded_equal(a: chunk.Chunk, b: chunk.Chunk) -> bool:
    return (a.header == b.header and np.array_equal(a.token_ids, b.token_ids)
            and all(np.array_equal(a.entries[n].codes, b.entries[n].codes)
                    and np.array_equal(a.entries[n].scales, b.entries[n].scales) for n in a.entries))


def assert_well_formed(c: chunk.Chunk, blob: bytes) -> None:
    """What a decoded chunk promises whatever its table: every view inside the blob, of the layout's shape."""
    h = c.header
    assert h.total_bytes == len(blob) and c.token_ids.shape == (h.token_count,)
    for cache in TINY.caches:
        e = c.entries[cache.name]
        assert e.codes.shape == (cache.entries_for(h.token_count), cache.code_bytes)
        assert e.scales.shape == (cache.entries_for(h.token_count), cache.scale_bytes)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
       st.booleans())
def test_any_byte_mutation_decodes_identically_or_is_a_chunk_error(edits: list[tuple[int, int]],
                                                                   reseal: bool) -> None:
    """Without a resealed checksum: the identical chunk (the bytes did not change) or a ChunkError.
    With one (damage the checksum cannot see, or a hostile writer): a well-formed chunk or a
    ChunkError. Never another exception."""
    b = bytearray(VALID)
    for pos, value in edits:
        b[pos] = value
    blob = resealed(b) if reseal else bytes(b)
    try:
        c = chunk.decode(blob, TINY)
    except chunk.ChunkError:
        return
    if not reseal or blob == VALID:
        assert blob == VALID
        assert decoded_equal(c, chunk.decode(VALID, TINY))
    else:
        assert_well_formed(c, blob)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, VALID_HEADER - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(-8, 8))
def test_header_and_table_mutations_with_a_valid_checksum_are_chunk_errors_or_well_formed(
        edits: list[tuple[int, int]], resize: int) -> None:
    """The header and section table, where a reader's bounds live, mutated and resealed; the buffer
    also cut or extended (then total_bytes may or may not follow)."""
    b = bytearray(VALID)
    for pos, value in edits:
        b[pos] = value
    if resize < 0:
        del b[resize:]
    else:
        b += bytes(resize)
    blob = resealed(b) if len(b) >= 8 else bytes(b)
    try:
        c = chunk.decode(blob, TINY)
    except chunk.ChunkError:
        return
    assert_well_formed(c, blob)


# -- through the daemon ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("validation") / "data") as d:
        yield d


@pytest.fixture(params=["grpc", "local-socket"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(daemon: Daemon, transport: str) -> Iterator[Client]:
    """A stream client over TCP, or an arena client (its calls go over the daemon's local socket)."""
    with Client(address=daemon.address, shared_memory=transport == "local-socket", arena_bytes=4 << 20) as c:
        c.connect()
        assert (c._local is not None) == (transport == "local-socket")
        yield c


def test_the_daemon_refuses_bad_chunk_fields_and_stores_nothing(client: Client, transport: str) -> None:
    s = make_session(session_id=f"chunks-{transport}", tokens=512, seed=11 if transport == "grpc" else 13)
    blob = s.blobs[0]
    h = chunk.read_header(blob)
    cases = {"compressible_offset past its end": (with_u32(blob, _COMPRESSIBLE_AT, h.total_bytes + 100),
                                                  "chunk 0: compressible_offset"),
             "section table past total_bytes": (table_past_the_end(), "chunk 0: tokens_offset 0 is before")}
    for name, (bad, message) in cases.items():
        code, got = status_of(lambda bad=bad: client.save_chunks("ns", TINY.layout_id, ROOT, 0, [bad]))
        assert (name, code) == (name, grpc.StatusCode.INVALID_ARGUMENT) and message in got, got
        assert "unpack" not in got and "buffer" not in got
    assert client.lookup("ns", TINY.layout_id, s.token_ids[:256].tolist()).chunks == 0  # nothing was stored
    assert list(client.load_chunks("ns", [h.key])) == []
    # as the trailing span of a commit, too
    bad_tail = with_u32(s.manifest.tail, _COMPRESSIBLE_AT, len(s.manifest.tail) + 4)
    code, got = status_of(lambda: client.save_session(dataclasses.replace(s.manifest, tail=bad_tail), s.blobs))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "trailing span: compressible_offset" in got
    assert s.session_id not in {x.session_id for x in client.list_sessions("ns")}
    assert save_session(client, s).token_count == 512  # the good version saves


# -- manifests: last token ids and retention ---------------------------------------------------------
def bad_manifests(m: Manifest) -> dict[str, tuple[Manifest, str]]:
    """A manifest of >= 128 tokens whose tail holds >= 1 token, broken one way each; the message."""
    ids = m.last_token_ids
    wrong_tail = ((ids[-1] + 1) % 256,)
    return {
        "3 last ids": (replace(m, last_token_ids=ids[-3:]), "last_token_ids holds 3 ids; a session of"),
        "628 last ids": (replace(m, last_token_ids=(7,) * 500 + ids), "last_token_ids holds 628 ids"),
        "no last ids": (replace(m, last_token_ids=()), "last_token_ids holds 0 ids"),
        "last ids contradict the tail": (replace(m, last_token_ids=ids[:-1] + wrong_tail),
                                         "disagree with the trailing span's token ids: token "
                                         f"{m.token_count - 1} is {wrong_tail[0]}"),
        "an id over u32": (replace(m, last_token_ids=(1 << 32, *ids[1:])), "last_token_ids[0] is 4294967296"),
        "negative ttl": (replace(m, retention=Retention(ttl_s=-5)), "retention.ttl_s must be a positive"),
        "NaN ttl": (replace(m, retention=Retention(ttl_s=math.nan)), "retention.ttl_s must be a positive"),
    }


def test_the_store_refuses_bad_manifests_and_keeps_the_stored_version(sessions: SessionStore) -> None:
    s = build_session("ns", "s", np.arange(1000, 1000 + 9 * CHUNK_TOKENS + 5, dtype=np.uint32))
    save(sessions, s)
    before = sessions.get("ns", "s")
    for name, (bad, message) in bad_manifests(s.manifest()).items():
        for call in (lambda bad=bad: sessions.commit(bad),
                     lambda bad=bad: sessions.save_session("ns", TINY8.layout_id, ROOT, 0, s.blobs, bad)):
            with pytest.raises(InvalidArgument, match=re.escape(message)):
                call()
            assert (name, sessions.get("ns", "s")) == (name, before)
    with pytest.raises(InvalidArgument, match=r"retention\.ttl_s"):
        sessions.touch("ns", "s", Retention(ttl_s=-5))
    assert sessions.get("ns", "s") == before


@pytest.mark.parametrize("tokens", [0, 1, 127, 128, 129, CHUNK_TOKENS, 9 * CHUNK_TOKENS + 3])
def test_every_session_length_takes_its_last_min_n_128_ids(sessions: SessionStore, tokens: int) -> None:
    s = build_session("ns", f"n{tokens}", np.arange(5, 5 + tokens, dtype=np.uint32))
    m = save(sessions, s)
    assert m.last_token_ids == tuple(range(5, 5 + tokens))[-128:]


def test_the_daemon_refuses_bad_manifests_on_both_calls_and_keeps_the_stored_version(client: Client,
                                                                                  transport: str) -> None:
    s = make_session(session_id=f"manifests-{transport}", tokens=600, seed=12)  # a 88-token tail
    first = save_session(client, s)
    for name, (bad, message) in bad_manifests(s.manifest).items():
        if name == "an id over u32":  # the wire's ids are u32: protobuf refuses it in the client
            continue
        for call in (lambda bad=bad: client.commit(bad), lambda bad=bad: client.save_session(bad, s.blobs)):
            code, got = status_of(call)
            assert (name, code) == (name, grpc.StatusCode.INVALID_ARGUMENT) and message in got, got
            assert (name, client.get_session("ns", s.session_id)[0]) == (name, first)
    code, got = status_of(lambda: client.touch_session("ns", s.session_id, Retention(ttl_s=math.nan)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s" in got
    fresh = replace(s.manifest, session_id=f"never-{transport}", retention=Retention(ttl_s=-5))
    assert status_of(lambda: client.commit(fresh))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert fresh.session_id not in {x.session_id for x in client.list_sessions("ns")}


# -- manifests as stored: what is damage --------------------------------------------------------------
def framed(meta: bytes, tail: bytes, meta_len: int | None = None, tail_len: int | None = None) -> bytes:
    """Manifest bytes around ``meta`` and ``tail`` (lengths as given), with a valid checksum."""
    body = (struct.pack("<4sHI", b"KVMF", 1, len(meta) if meta_len is None else meta_len) + meta
            + struct.pack("<I", len(tail) if tail_len is None else tail_len) + tail)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def damaged_manifests(m: Manifest) -> dict[str, bytes]:
    good = json.loads(m.encode()[10 : 10 + struct.unpack_from("<I", m.encode(), 6)[0]])

    def meta(**change: object) -> bytes:
        d = {k: v for k, v in {**good, **change}.items() if v is not ...}
        return json.dumps(d).encode()

    return {
        "meta_len past the end": framed(meta(), m.tail, meta_len=10_000),
        "tail_len past the end": framed(meta(), m.tail, tail_len=len(m.tail) + 1),
        "tail_len short of the checksum": framed(meta(), m.tail, tail_len=len(m.tail) - 1),
        "meta is a list": framed(b"[]", m.tail),
        "meta is not UTF-8": framed(b'{"session_id": "\xff"}', m.tail),
        "meta is not JSON": framed(b"{", m.tail),
        "a key missing": framed(meta(retention=...), m.tail),
        "token_count a string": framed(meta(token_count="12"), m.tail),
        "chunk_keys not a list": framed(meta(chunk_keys="00"), m.tail),
        "a chunk key not hex": framed(meta(chunk_keys=["zz"]), m.tail),
        "a last id negative": framed(meta(last_token_ids=[-1]), m.tail),
        "pinned not a bool": framed(meta(retention={"pinned": 1, "ttl_s": None}), m.tail),
        "metadata not strings": framed(meta(metadata={"a": 1}), m.tail),
        "generation a float": framed(meta(generation=1.5), m.tail),
        "a bad session id": framed(meta(session_id="../x"), m.tail),
    }


def test_damaged_manifest_shapes_are_manifest_errors() -> None:
    m = make_session(tokens=300).manifest
    assert Manifest.decode(framed(json.dumps(json.loads(m.encode()[10:-12 - len(m.tail)])).encode(), m.tail)) == m
    for name, blob in damaged_manifests(m).items():
        with pytest.raises(ManifestError):
            Manifest.decode(blob)
            pytest.fail(name)
    legacy = json.loads(m.encode()[10:-12 - len(m.tail)])
    del legacy["generation"]  # written before version stamps: version 0
    assert Manifest.decode(framed(json.dumps(legacy).encode(), m.tail)).generation == 0


def test_a_store_opens_past_damaged_manifests_and_counts_them(tmp_path: Path) -> None:
    """A manifest whose checksum holds but whose JSON lacks a key raised KeyError at open: the store
    did not open at all."""
    ss = open_store(store_config(tmp_path))
    s = build_session("ns", "good", np.arange(200, dtype=np.uint32))
    save(ss, s)
    damaged = damaged_manifests(s.manifest())
    for i, blob in enumerate(damaged.values()):
        ss.store.put_meta(manifest_key("ns", f"bad{i}"), blob)
    ss.close()
    ss = open_store(store_config(tmp_path))
    try:
        assert ss.damage.manifests == len(damaged)
        assert [m.session_id for m in ss.list_sessions()] == ["good"]
    finally:
        ss.close()
