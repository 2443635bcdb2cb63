"""Stream framing (kvstore.transport.framing) and the guarded open of same-host arenas
(kvstore.transport.shm), without a daemon."""

from __future__ import annotations

import itertools
import os
import stat
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidArgument
from kvstore.format import chunk
from kvstore.format.layout import get_layout
from kvstore.server import arena_attach
from kvstore.transport import fastpb, framing, shm
from kvstore.transport.carrier import StreamCarrier
from kvstore.v1 import kvstore_pb2 as pb

TINY8 = get_layout("tiny-8")


def small_chunk(tokens: int, fill: int) -> bytes:
    """A real chunk of a few tokens (the smallest the codec makes: a few hundred bytes)."""
    entries = {c.name: chunk.Entries(np.full((c.entries_for(tokens), c.code_bytes), fill, np.uint8),
                                     np.full((c.entries_for(tokens), c.scale_bytes), fill, np.uint8))
               for c in TINY8.caches}
    return chunk.encode(TINY8, key=bytes([fill]) * 16, start=0, token_ids=list(range(tokens)), entries=entries)


BLOBS = [small_chunk(0, 1), small_chunk(1, 2), small_chunk(0, 3)]
STREAM = b"".join(BLOBS)


def assemble(*messages: bytes) -> list[bytes]:
    a = framing.BlobAssembler()
    out = [bytes(b) for m in messages for b in a.feed(m)]
    a.finish()
    return out


# -- BlobAssembler --------------------------------------------------------------------------------
def test_every_split_into_two_or_three_messages() -> None:
    """Cut the stream of 3 chunks at every pair of positions i <= j (i == j, i == 0 or j == end give
    two messages, or one): the same 3 blobs come out every time."""
    n = len(STREAM)
    for i in range(n + 1):
        for j in range(i, n + 1):
            assert assemble(STREAM[:i], STREAM[i:j], STREAM[j:]) == BLOBS, (i, j)


def test_a_blob_within_one_message_is_not_copied() -> None:
    message = STREAM + BLOBS[0][:100]
    a = framing.BlobAssembler()
    out = a.feed(message)
    assert [bytes(b) for b in out] == BLOBS
    assert all(isinstance(b, memoryview) and b.obj is message for b in out)  # slices of the message
    assert [bytes(b) for b in a.feed(BLOBS[0][100:])] == BLOBS[:1]  # the spanning one was assembled
    a.finish()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3 * len(STREAM)), max_size=8), st.integers(1, 3))
def test_any_split_of_a_longer_stream(cuts: list[int], repeat: int) -> None:
    stream = STREAM * repeat
    bounds = [0, *sorted(min(c, len(stream)) for c in cuts), len(stream)]
    assert assemble(*(stream[a:b] for a, b in itertools.pairwise(bounds))) == BLOBS * repeat


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 13, 200, len(BLOBS[0]) - 1, len(BLOBS[0]) + 3])
def test_truncated_stream_fails_at_finish(cut: int) -> None:
    a = framing.BlobAssembler()
    a.feed(STREAM[:cut])
    with pytest.raises(InvalidArgument, match="truncated"):
        a.finish()


def test_empty_stream_is_fine() -> None:
    assert assemble() == [] and assemble(b"", b"") == []


@pytest.mark.parametrize("garbage", [b"\x00" * 300, b"KVCX" + bytes(300), b"not a chunk at all"])
def test_garbage_magic_is_refused(garbage: bytes) -> None:
    with pytest.raises(InvalidArgument, match="does not start a chunk"):
        assemble(garbage)
    with pytest.raises(InvalidArgument, match="does not start a chunk"):
        assemble(BLOBS[0] + garbage)  # after a good blob, too


def test_declared_size_is_checked_before_buffering() -> None:
    huge = bytearray(BLOBS[0])
    struct.pack_into("<I", huge, 8, 1 << 30)
    with pytest.raises(InvalidArgument, match="exceeds the 4096-byte limit"):
        framing.BlobAssembler(max_blob=4096).feed(bytes(huge[:12]))  # before any payload arrives
    tiny = bytearray(BLOBS[0])
    struct.pack_into("<I", tiny, 8, 40)
    with pytest.raises(InvalidArgument, match="less than a header"):
        assemble(bytes(tiny))


# -- pack -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_bytes", [1, 7, 12, 216, 217, 400, 10_000])
def test_pack_respects_max_bytes_and_indices(max_bytes: int) -> None:
    blobs = [*BLOBS, small_chunk(2, 4)]
    messages = [(b"".join(parts), idx) for parts, idx in framing.pack(blobs, max_bytes)]
    assert all(0 < len(data) <= max_bytes for data, _ in messages)
    assert b"".join(data for data, _ in messages) == b"".join(blobs)
    # each blob's index is reported in the message holding its first byte, and only there
    starts = np.cumsum([0, *map(len, blobs)])[:-1]
    offsets = np.cumsum([0, *(len(d) for d, _ in messages)])
    for i, start in enumerate(starts):
        holder = int(np.searchsorted(offsets, start, side="right")) - 1
        assert [m for m, (_, idx) in enumerate(messages) if i in idx] == [holder]
    # the receiver pairs blobs with indices as the client does: a blob may complete messages later
    a, pending, got = framing.BlobAssembler(), [], []
    for data, idx in messages:
        pending.extend(idx)
        got += [(pending.pop(0), bytes(b)) for b in a.feed(data)]
    a.finish()
    assert got == list(enumerate(blobs)) and pending == []


def test_pack_of_nothing_is_no_message() -> None:
    assert list(framing.pack([], 100)) == []


# -- answers encoded by hand (kvstore.transport.fastpb): exactly protobuf's bytes ------------------------------
@pytest.mark.parametrize("max_bytes", [7, 216, 400, 10_000])
def test_hand_encoded_answers_are_protobufs_bytes(max_bytes: int) -> None:
    blobs = [*BLOBS, small_chunk(2, 4)]
    session = pb.Session(session_id="s", namespace="ns", chunk_keys=[bytes(16)] * len(blobs), token_count=300)
    pieces = list(StreamCarrier(max_bytes).send((i + 200, b) for i, b in enumerate(blobs)))
    for n, p in enumerate(pieces):
        msg = pb.ChunkData(data=p.data, indices=p.indices)
        assert fastpb.chunk_data_message(p.parts, p.indices).raw == msg.SerializeToString()
        first = session if n == 0 else None
        raw = fastpb.load_session_message(first.SerializeToString() if first else None, p.encoded()).raw
        assert raw == pb.LoadSessionResponse(session=first, chunks=msg).SerializeToString()
        assert pb.LoadSessionResponse.FromString(raw).chunks == msg


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_hand_encoded_indices_of_any_size(indices: list[int]) -> None:
    raw = fastpb.chunk_data_message([b"abc"], indices).raw
    assert raw == pb.ChunkData(data=b"abc", indices=indices).SerializeToString()


# -- arenas: what the guarded open refuses --------------------------------------------------------
NAME = "kvstore-cli-" + "ab" * 16
SIZE = 1 << 16


def attach(path: str | Path, directory: Path, nonce: bytes = bytes(16)) -> shm.ArenaMemory:
    return arena_attach.attach_file(str(path), directory, SIZE, nonce)


def write_file(path: Path) -> None:
    path.write_bytes(bytes(SIZE))


@pytest.mark.parametrize("name", ["other-file", "kvstore-cli-1234", "kvstore-xyz-" + "ab" * 16, NAME + "0",
                                  "kvstore-cli-" + "AB" * 16, "kvstore-srv-" + "ab" * 16])
def test_attach_refuses_wrong_names(tmp_path: Path, name: str) -> None:
    write_file(tmp_path / name)
    with pytest.raises(InvalidArgument, match="not a kvstore client file"):
        attach(tmp_path / name, tmp_path)
    assert (tmp_path / name).exists()  # refused files are left alone


def test_attach_refuses_paths_outside_the_directory(tmp_path: Path) -> None:
    d, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    d.mkdir()
    elsewhere.mkdir()
    write_file(elsewhere / NAME)
    (d / "sub").mkdir()
    write_file(d / "sub" / NAME)
    (d / "link").symlink_to(elsewhere)
    for path in (elsewhere / NAME, d / "sub" / NAME, d / "link" / NAME, f"{d}/../elsewhere/{NAME}"):
        with pytest.raises(InvalidArgument, match="not a kvstore client file"):
            attach(path, d)
    assert (elsewhere / NAME).exists() and (d / "sub" / NAME).exists()


def test_attach_does_not_follow_symlinks(tmp_path: Path) -> None:
    d = tmp_path / "shm"
    d.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    (d / NAME).symlink_to(secret)
    with pytest.raises(InvalidArgument, match="cannot open arena"):
        attach(d / NAME, d)
    assert secret.read_bytes() == b"not yours"
    with pytest.raises(InvalidArgument, match="cannot open arena"):
        attach(d / ("kvstore-cli-" + "cd" * 16), d)  # missing


def test_attach_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    """Opening a FIFO blocks until the other end opens: it must be refused at once instead (the call
    runs in a thread, so a blocking open fails the join rather than hanging the run)."""
    os.mkfifo(tmp_path / NAME)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            attach(tmp_path / NAME, tmp_path)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # unblock a blocking open so the thread ends
        with open(tmp_path / NAME, "rb"):
            pass
    assert outcome and isinstance(outcome[0], InvalidArgument) and "not a regular file" in str(outcome[0])
    assert (tmp_path / NAME).exists()


def test_attach_refuses_a_directory(tmp_path: Path) -> None:
    (tmp_path / NAME).mkdir()
    with pytest.raises(InvalidArgument, match="Is a directory"):
        attach(tmp_path / NAME, tmp_path)


def test_attach_refuses_a_hard_link(tmp_path: Path) -> None:
    arena = shm.Arena.create(tmp_path, SIZE)
    os.link(arena.path, tmp_path / NAME)
    for p in (arena.path, str(tmp_path / NAME)):
        with pytest.raises(InvalidArgument, match="hard link is refused"):
            attach(p, tmp_path, arena.nonce)
    assert os.path.exists(arena.path) and (tmp_path / NAME).exists()  # refused files are left alone
    arena.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_attach_refuses_another_users_file(tmp_path: Path) -> None:
    arena = shm.Arena.create(tmp_path, SIZE)
    os.chown(arena.path, 65534, 65534)
    with pytest.raises(InvalidArgument, match="not owned by"):
        attach(arena.path, tmp_path, arena.nonce)
    arena.close()


def test_arena_files_are_private(tmp_path: Path) -> None:
    arena = shm.Arena.create(tmp_path, SIZE)
    assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600
    assert bytes(arena.view[: shm.NONCE_BYTES]) == arena.nonce
    arena.close()


def test_arena_attach_needs_the_creators_nonce(tmp_path: Path) -> None:
    arena = shm.Arena.create(tmp_path, 1 << 16)
    for nonce, message in ((bytes(16), "does not hold the nonce"), (b"", "nonce must be 16 bytes"),
                           (arena.nonce[:8], "nonce must be 16 bytes")):
        with pytest.raises(InvalidArgument, match=message):
            arena_attach.attach_file(arena.path, tmp_path, arena.size, nonce)
    attached = arena_attach.attach_file(arena.path, tmp_path, arena.size, arena.nonce)
    arena.view[100:104] = b"abcd"  # the same memory: the client's mapping, the daemon's reads
    assert attached.read(100, 4) == b"abcd"
    attached.close()
    arena.close()


def test_the_client_parses_stream_answers_without_copying() -> None:
    blobs = [*BLOBS, small_chunk(2, 4)]
    session = pb.Session(session_id="s", namespace="ns", chunk_keys=[bytes(16)] * len(blobs))
    for n, p in enumerate(StreamCarrier(400).send(enumerate(blobs))):
        raw = fastpb.load_session_message(session.SerializeToString() if n == 0 else None, p.encoded()).raw
        got = fastpb.parse_load_session(raw)
        assert got.session == (session if n == 0 else None)
        assert isinstance(got.chunks, fastpb.StreamChunks) and got.chunks.data.obj is raw  # a view, no copy
        assert bytes(got.chunks.data) == p.data and got.chunks.indices == list(p.indices)
        c = fastpb.parse_chunk_data(b"".join(p.encoded()))
        assert bytes(c.data) == p.data and list(c.indices) == list(p.indices)


def test_anything_else_is_left_to_protobuf() -> None:
    arena = pb.ChunkData(shm=pb.ShmHandle(arena_id="a", indices=[0], offsets=[0], sizes=[9], size=9))
    assert fastpb.parse_chunk_data(arena.SerializeToString()) == arena
    got = fastpb.parse_load_session(pb.LoadSessionResponse(chunks=arena).SerializeToString())
    assert got.session is None and got.chunks == arena
    unpacked = b"\x0a\x03abc\x10\x05\x10\x07"  # indices as separate varints: valid protobuf too
    assert fastpb.parse_chunk_data(unpacked).indices == [5, 7]
    assert fastpb.parse_load_session(b"").chunks is None


@pytest.mark.parametrize("raw", [b"\x0a\x05ab", b"\x12\x80", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"])
def test_a_truncated_answer_is_refused(raw: bytes) -> None:
    with pytest.raises(InvalidArgument):
        fastpb.parse_chunk_data(raw)
