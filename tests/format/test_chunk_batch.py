"""kvstore.format.chunk_batch: a batch of blobs checked (and copied) at once says, for every blob,
exactly what the per-chunk checks say (chunk.read_header, chunk.verify_checksum and the per-chunk
chunk_matches), by the C kernel and by the Python reference alike, for any corrupted byte, truncation,
wrong key, wrong claim and bad header field."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.format import chunk, chunk_batch
from kvstore.format.chunk_batch import BatchResult, Expected, Status
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.layout import get_layout
from kvstore.store.sessions.chunk_index import ChunkInfo
from tests.helpers.store import chunk_matches

LAYOUT = get_layout("tiny-16")
CT, N, NS = 16, 6, "batch-ns"


def _session(seed: int = 0) -> tuple[list[bytes], list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1 << 32, N * CT, dtype=np.uint64)
    keys = chain_keys(LAYOUT.layout_id, NS, ids, CT)
    blobs = []
    for i, k in enumerate(keys):
        ents = {c.name: chunk.Entries(rng.integers(0, 256, (c.entries_for(CT), c.code_bytes), dtype=np.uint8),
                                      rng.integers(0, 256, (c.entries_for(CT), c.scale_bytes), dtype=np.uint8))
                for c in LAYOUT.caches}
        blobs.append(chunk.encode(LAYOUT, key=k, start=i * CT, token_ids=ids[i * CT : (i + 1) * CT], entries=ents))
    return blobs, keys, ids


BLOBS, KEYS, IDS = _session()
EXPECTED = Expected.chain(KEYS, LAYOUT.layout_id, NS, CT)
INFOS = [ChunkInfo(NS, LAYOUT.layout_id, KEYS[i - 1] if i else ROOT, i) for i in range(N)]
SIZE = len(BLOBS[0])

Check = Callable[..., BatchResult]
IMPLS: dict[str, Check] = {"reference": chunk_batch.check_reference}
if chunk_batch.NATIVE:
    IMPLS["c"] = chunk_batch.check


def statuses(blobs: list[Any], expected: Expected = EXPECTED, **kw: Any) -> list[Status]:
    """The statuses every implementation gives (asserted equal), as a list."""
    got = {name: fn(blobs, expected, **kw).status.tolist() for name, fn in IMPLS.items()}
    if chunk_batch.NATIVE:
        assert got["c"] == got["reference"], got
        packed = b"".join(b"" if b is None else bytes(b) for b in blobs)
        lens = [0 if b is None else memoryview(b).nbytes for b in blobs]
        offs = np.cumsum([0, *lens])[:-1]
        p = chunk_batch.check_packed(packed, offs, lens, expected, **kw).status.tolist()
        want = [Status.TRUNCATED if b is None else s for b, s in zip(blobs, got["reference"])]  # no None in a buffer
        assert p == want
    return [Status(s) for s in got["reference"]]


def per_chunk(blobs: list[Any]) -> list[bool]:
    """What the store's per-chunk check says of each blob."""
    return [b is not None and chunk_matches(k, info, CT, b) for k, info, b in zip(KEYS, INFOS, blobs)]


def resealed(blob: bytes | bytearray) -> bytes:
    """``blob`` with its checksum recomputed (so that the checks after the checksum see it)."""
    out = bytearray(blob)
    struct.pack_into("<Q", out, len(out) - 8, xxhash.xxh3_64_intdigest(bytes(out[:-8])))
    return bytes(out)


def test_the_kernel_is_built() -> None:
    # CI installs with setup.py's extensions (pip install -e .): the C kernel must be the one answering there
    assert chunk_batch.NATIVE


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_sound_session_is_valid_and_copied_whole(impl: str) -> None:
    dest = np.full(N * SIZE + 7, 0xAB, np.uint8)
    r = IMPLS[impl](BLOBS, EXPECTED, dest=dest.data, dest_offsets=[i * SIZE for i in range(N)])
    assert r.all_valid and r.valid.all() and r.failures() == {}
    assert dest[: N * SIZE].tobytes() == b"".join(BLOBS)
    assert (dest[N * SIZE :] == 0xAB).all()


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_threads_give_the_same_answer(threads: int) -> None:
    blobs: list[Any] = list(BLOBS)
    blobs[1], blobs[4] = blobs[1][:-1], None
    dest = np.zeros(N * SIZE, np.uint8)
    r = chunk_batch.check(blobs, EXPECTED, dest=dest.data, dest_offsets=[i * SIZE for i in range(N)], threads=threads)
    assert r.failures() == {1: Status.TRUNCATED, 4: Status.MISSING}
    for i in (0, 2, 3, 5):
        assert dest[i * SIZE : (i + 1) * SIZE].tobytes() == BLOBS[i]


@settings(max_examples=400, deadline=None)
@given(st.integers(0, N - 1), st.integers(0, SIZE * 8 - 1))
def test_any_flipped_bit_is_invalid_as_the_per_chunk_check_says(which: int, bit: int) -> None:
    blobs: list[Any] = list(BLOBS)
    bad = bytearray(blobs[which])
    bad[bit // 8] ^= 1 << (bit % 8)
    blobs[which] = bytes(bad)
    got = statuses(blobs)
    assert [s == Status.VALID for s in got] == per_chunk(blobs)
    assert got[which] != Status.VALID and all(s == Status.VALID for i, s in enumerate(got) if i != which)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, N - 1), st.integers(0, SIZE - 1), st.binary(max_size=9))
def test_a_truncated_or_extended_blob_is_invalid(which: int, keep: int, extra: bytes) -> None:
    blobs: list[Any] = list(BLOBS)
    blobs[which] = blobs[which][:keep]
    got = statuses(blobs)
    assert [s == Status.VALID for s in got] == per_chunk(blobs) and got[which] != Status.VALID
    if extra:
        blobs[which] = BLOBS[which] + extra
        got = statuses(blobs)
        assert got[which] == Status.OVERSIZED and per_chunk(blobs)[which] is False


_FIELDS = {"version": (4, "<H"), "header_bytes": (6, "<H"), "total": (8, "<I"), "token_count": (12, "<I"),
           "start": (16, "<Q"), "tokens_offset": (56, "<I"), "n_sections": (60, "<H"), "compressible": (64, "<I")}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(_FIELDS)), st.integers(0, 2**64 - 1), st.booleans(), st.integers(0, N - 1))
def test_any_header_field_mutated_gives_the_same_status(field: str, value: int, reseal: bool, which: int) -> None:
    """Every branch of the header checks: a field set to any value, the checksum fixed or not. (Resealed,
    a moved compressible_offset still passes, as it passes the per-chunk check: a load's checks are the
    header's bounds, the checksum and the key; the save checked the section table.)"""
    at, fmt = _FIELDS[field]
    bad = bytearray(BLOBS[which])
    struct.pack_into(fmt, bad, at, value % (1 << (8 * struct.calcsize(fmt))))
    blobs: list[Any] = list(BLOBS)
    blobs[which] = resealed(bad) if reseal else bytes(bad)
    got = statuses(blobs)
    assert [s == Status.VALID for s in got] == per_chunk(blobs)
    if bytes(bad) != BLOBS[which] and not reseal:
        assert got[which] != Status.VALID


def test_each_reason_is_named() -> None:
    b = BLOBS[2]
    cases: dict[Status, bytes] = {
        Status.TRUNCATED: b[:79],
        Status.BAD_MAGIC: b"XXXX" + b[4:],
        Status.BAD_VERSION: b[:4] + struct.pack("<H", 2) + b[6:],
        Status.MALFORMED: resealed(b[:64] + struct.pack("<I", 1) + b[68:]),  # compressible_offset before the table
        Status.CHECKSUM: b[:100] + bytes([b[100] ^ 1]) + b[101:],
        Status.OVERSIZED: b + b"\0",
    }
    for want, blob in cases.items():
        blobs: list[Any] = list(BLOBS)
        blobs[2] = blob
        assert statuses(blobs)[2] == want, want


@pytest.mark.parametrize("what", ["key", "layout", "start", "token_count"])
def test_an_expectation_the_header_does_not_meet_is_a_claim_failure(what: str) -> None:
    keys, starts, layouts = list(KEYS), EXPECTED.starts.copy(), [LAYOUT.layout_id] * N  # type: ignore[union-attr]
    if what == "key":
        keys[3] = bytes(range(16))
    elif what == "layout":
        layouts[3] = get_layout("tiny-8").layout_id
    elif what == "start":
        starts[3] += CT
    e = Expected(keys, layouts, starts, CT + (what == "token_count"), NS, EXPECTED.parents)
    got = statuses(list(BLOBS), e)
    if what == "token_count":
        assert got == [Status.CLAIM] * N
    else:
        assert got == [Status.CLAIM if i == 3 else Status.VALID for i in range(N)]


def test_a_key_its_token_ids_do_not_give_is_a_key_failure() -> None:
    """A sound, checksummed chunk that claims the expected key but holds other token ids (a collision,
    or a chunk planted under another's key): the per-chunk check and the batch both refuse it."""
    c = chunk.decode(BLOBS[3], LAYOUT)
    planted = chunk.encode(LAYOUT, key=KEYS[3], start=3 * CT, token_ids=c.token_ids[::-1].copy(), entries=c.entries)
    blobs: list[Any] = list(BLOBS)
    blobs[3] = planted
    assert statuses(blobs)[3] == Status.KEY and per_chunk(blobs)[3] is False
    wrong_parent = Expected(KEYS, LAYOUT.layout_id, EXPECTED.starts, CT, NS, [ROOT] * N)
    assert statuses(list(BLOBS), wrong_parent) == [Status.VALID] + [Status.KEY] * (N - 1)
    wrong_ns = Expected(KEYS, LAYOUT.layout_id, EXPECTED.starts, CT, "other", EXPECTED.parents)
    assert statuses(list(BLOBS), wrong_ns) == [Status.KEY] * N
    # without parents the key is not recomputed: the claims alone
    assert statuses(blobs, Expected(KEYS, LAYOUT.layout_id, EXPECTED.starts, CT))[3] == Status.VALID


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_failures_and_blobs_without_room_leave_their_slots_alone(impl: str) -> None:
    blobs: list[Any] = list(BLOBS)
    blobs[0], blobs[2] = None, BLOBS[2][:-3] + b"abc"
    dest = np.full(N * SIZE - 1, 0xAB, np.uint8)  # the last blob does not fit
    slots = [SIZE] * N
    slots[4] = SIZE - 1
    r = IMPLS[impl](blobs, EXPECTED, dest=dest.data, dest_offsets=[i * SIZE for i in range(N)], slot_sizes=slots)
    assert r.failures() == {0: Status.MISSING, 2: Status.CHECKSUM, 4: Status.NO_ROOM, 5: Status.NO_ROOM}
    for i in range(N):
        slot = dest[i * SIZE : (i + 1) * SIZE]
        assert slot.tobytes() == BLOBS[i] if i in (1, 3) else (slot == 0xAB).all()


def test_views_and_arrays_are_blobs_too() -> None:
    blobs: list[Any] = [memoryview(BLOBS[0]), bytearray(BLOBS[1]), np.frombuffer(BLOBS[2], np.uint8),
                        memoryview(BLOBS[3]).cast("B", (SIZE // 8, 8)) if SIZE % 8 == 0 else BLOBS[3], *BLOBS[4:]]
    assert statuses(blobs) == [Status.VALID] * N


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_arguments_that_do_not_describe_the_batch_raise(impl: str) -> None:
    fn = IMPLS[impl]
    with pytest.raises(ValueError, match="keys"):
        fn(BLOBS[:-1], EXPECTED)
    with pytest.raises(ValueError, match="writable"):
        fn(BLOBS, EXPECTED, dest=bytes(N * SIZE), dest_offsets=[0] * N)
    with pytest.raises(ValueError, match="dest_offsets"):
        fn(BLOBS, EXPECTED, dest=bytearray(N * SIZE), dest_offsets=[-1] * N)
    with pytest.raises(ValueError, match="starts"):
        fn(BLOBS, Expected(KEYS, LAYOUT.layout_id, [-CT] * N, CT))
    with pytest.raises(ValueError, match="contiguous"):
        fn([memoryview(BLOBS[0])[::2], *BLOBS[1:]], EXPECTED)
    with pytest.raises(ValueError, match="within"):
        chunk_batch.check_packed(b"".join(BLOBS), [i * SIZE for i in range(N)], [SIZE + 1] * N, EXPECTED)


def test_without_the_kernel_the_reference_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build without the C extension: the same statuses (and copies) from the same calls."""
    blobs: list[Any] = list(BLOBS)
    blobs[1], blobs[3] = None, BLOBS[3][:-1]
    want = chunk_batch.check(blobs, EXPECTED).status.tolist()
    monkeypatch.setattr(chunk_batch, "_chunks", None)
    dest = np.zeros(N * SIZE, np.uint8)
    r = chunk_batch.check(blobs, EXPECTED, dest=dest.data, dest_offsets=[i * SIZE for i in range(N)])
    assert r.status.tolist() == want and r.failures() == {1: Status.MISSING, 3: Status.TRUNCATED}
    assert dest[:SIZE].tobytes() == BLOBS[0]
    packed = chunk_batch.check_packed(dest.data, [i * SIZE for i in range(N)], [SIZE] * N, EXPECTED)
    assert packed.failures() == {1: Status.BAD_MAGIC, 3: Status.BAD_MAGIC}  # the slots the copy left as zeros
