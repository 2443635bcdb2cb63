"""The carriers (kvstore/transport/carrier.py) without a daemon: a batch sent by one side and received by
the other comes out whole and in order, whichever way it travelled; a batch larger than the arena
puts what fits in the arena and streams the rest, in the same answer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.server import arena_attach
from kvstore.transport import shm
from kvstore.transport.carrier import ArenaCarrier, Carrier, Receiver, StreamCarrier
from kvstore.transport.framing import Blob
from tests.transport.test_transport import BLOBS, small_chunk

ITEMS = [(0, BLOBS[0]), (2, BLOBS[1]), (5, BLOBS[2]), (6, small_chunk(3, 9))]  # indices 1, 3, 4: misses


def round_trip(sender: Carrier, receiver: Receiver,
               items: list[tuple[int, Blob]] = ITEMS) -> tuple[list[tuple[int, bytes]], list[str]]:
    got, kinds = [], []
    for piece in sender.send(iter(items)):
        msg = piece.message()
        kinds.append("arena" if msg.HasField("shm") else "data")
        got += [(i, bytes(b)) for i, b in receiver.feed(msg)]
    receiver.finish()
    return got, kinds


@pytest.fixture(params=["sealed", "file"])
def arena_pair(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[shm.Arena, shm.ArenaMemory]:
    """Both sides of one arena: the client's mapping, and the daemon's hold on it (its mapping of a
    sealed memfd, or pread/pwrite on a file named by path)."""
    return _pair(tmp_path, 4096, request.param)


def _pair(tmp_path: Path, size: int, kind: str) -> tuple[shm.Arena, shm.ArenaMemory]:
    if kind == "sealed":
        mine = shm.Arena.create_sealed(size)
        return mine, arena_attach.attach_sealed(os.dup(mine.fd), mine.size, mine.nonce)
    mine = shm.Arena.create(tmp_path, size)
    return mine, arena_attach.attach_file(mine.path, tmp_path, mine.size, mine.nonce)


def test_stream_round_trip_in_small_messages() -> None:
    carrier = StreamCarrier(message_bytes=100)  # blobs span messages
    got, kinds = round_trip(carrier, carrier.receiver())
    assert got == [(i, bytes(b)) for i, b in ITEMS] and set(kinds) == {"data"}


def test_arena_batch_is_one_message(arena_pair: tuple[shm.Arena, shm.ArenaMemory]) -> None:
    mine, theirs = arena_pair
    daemon_side, client_side = ArenaCarrier(theirs, "id1"), ArenaCarrier(mine, "id1")
    got, kinds = round_trip(daemon_side, client_side.receiver(copy=False))
    assert got == [(i, bytes(b)) for i, b in ITEMS] and kinds == ["arena"] and not daemon_side.overflowed


@pytest.mark.parametrize("kind", ["sealed", "file"])
def test_a_batch_larger_than_the_arena_overflows_to_the_stream(tmp_path: Path, kind: str) -> None:
    fits = sum(len(b) for _, b in ITEMS[:2])
    mine, theirs = _pair(tmp_path, fits + 10, kind)  # the first two blobs fit, the third does not
    daemon_side = ArenaCarrier(theirs, "id1", message_bytes=150)
    got, kinds = round_trip(daemon_side, ArenaCarrier(mine, "id1").receiver(copy=True))
    assert got == [(i, bytes(b)) for i, b in ITEMS]
    assert kinds[0] == "arena" and set(kinds[1:]) == {"data"} and daemon_side.overflowed


def test_a_batch_with_no_room_at_all_is_all_stream(tmp_path: Path) -> None:
    mine = shm.Arena.create(tmp_path, 16)
    carrier = ArenaCarrier(mine, "id1")
    got, kinds = round_trip(carrier, carrier.receiver())
    assert got == [(i, bytes(b)) for i, b in ITEMS] and set(kinds) == {"data"} and carrier.overflowed


def test_zero_copy_views_and_copies(arena_pair: tuple[shm.Arena, shm.ArenaMemory]) -> None:
    mine, theirs = arena_pair
    msg = next(ArenaCarrier(theirs, "id1").send(iter(ITEMS[:1]))).message()
    (_, view), = ArenaCarrier(mine, "id1").receiver(copy=False).feed(msg)
    (_, copy), = ArenaCarrier(mine, "id1").receiver(copy=True).feed(msg)
    assert isinstance(view, memoryview) and view.obj is mine.view.obj and isinstance(copy, bytes)


def test_an_answer_naming_another_arena_or_bytes_beyond_it_is_refused(arena_pair: tuple[shm.Arena, shm.ArenaMemory]
                                                                      ) -> None:
    mine, theirs = arena_pair
    msg = next(ArenaCarrier(theirs, "id1").send(iter(ITEMS[:1]))).message()
    with pytest.raises(InvalidArgument, match="did not"):
        ArenaCarrier(mine, "id2").receiver().feed(msg)
    with pytest.raises(InvalidArgument, match="did not"):
        StreamCarrier().receiver().feed(msg)
    msg.shm.offsets[0] = mine.size
    with pytest.raises(InvalidArgument, match="beyond the arena"):
        ArenaCarrier(mine, "id1").receiver().feed(msg)


def test_a_save_arena_part_is_copied_out_and_bounded(arena_pair: tuple[shm.Arena, shm.ArenaMemory]) -> None:
    mine, theirs = arena_pair
    first = next(ArenaCarrier(mine, "id1").send(enumerate(BLOBS)))
    receiver = ArenaCarrier(theirs, "id1").receiver(copy=True)
    assert first.handle is not None
    blobs = receiver.arena_prefix(first.handle.size)
    mine.view[: first.handle.size] = bytes(first.handle.size)  # the sender scribbles afterwards: no effect
    assert [bytes(b) for b in blobs] == BLOBS
    with pytest.raises(InvalidArgument, match="exceeds the arena's 4096"):
        receiver.arena_prefix(4097)
