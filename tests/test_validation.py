"""What a save must satisfy (issue 19, second pass): chunks whose every field is checked, so any
malformed blob is a ``ChunkError`` with a message (never ``struct.error``); manifests whose last
token ids and retention are what docs/FORMAT.md says. Unit checks on the codec and the pure
validators, then the same inputs through a real daemon (gRPC and the local socket share the
servicer): INVALID_ARGUMENT saying what was wrong, and nothing stored changes."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import xxhash
from daemon_helpers import Daemon, make_session, running_daemon, save_session, status_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_record_codec import make_chunk

from kvstore import chunk
from kvstore.client import Client
from kvstore.keys import ROOT
from kvstore.layout import get_layout

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
    s = make_session(session_id=f"chunks-{transport}", tokens=512, seed=11)
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
