"""The one way chunk blobs travel between a client and the daemon: a ``Carrier``.

A carrier sends a batch of (index, blob) pairs as ``Piece``s, one per ``ChunkData`` message, and a
``Receiver`` turns those messages back into pairs. Two carriers exist, used the same way by the sync client, the async
client and the servicer:

- ``StreamCarrier``: the blobs back to back in the messages' ``data`` (kvstore.transport.framing).
- ``ArenaCarrier`` (same host): the blobs are copied into an arena both sides share (kvstore.transport.shm;
  the daemon maps only a sealed memfd, and reaches a file named by path with pread/pwrite:
  server/arena_attach.py); one message names their offsets. A batch larger than the arena overflows: what
  fits goes in the arena, the rest on the stream, in the same answer.

- ``CallerMemoryCarrier`` (same host, a load over the local socket that names ``CallerMemory``): the
  daemon writes the blobs straight into the caller's own buffer (kvstore.transport.cma); one message
  names their offsets there. Nothing overflows: a blob that does not fit fails the call.
  ``CallerSlotsCarrier``, its scatter form for engine pages: each page blob's payload written at its
  key's slot of the caller's region (kvstore/transport/slots.py).

A client picks its carrier once, when it connects: same host and an arena the daemon accepted
-> arena; anything else -> stream. The daemon builds a carrier per call from
what the call names: an arena id (the caller's own, see server/carriers.py) or none.
"""

from __future__ import annotations

import contextlib
import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Retry
from kvstore.format import chunk_batch, page
from kvstore.transport import cma, fastpb, framing, shm, slots
from kvstore.transport.framing import Blob
from kvstore.transport.sender import CALLER_MEMORY_REFUSED, Sender
from kvstore.v1 import kvstore_pb2 as pb

# the start of the daemon's answer to an arena id it does not know, or that another identity
# attached (Retry.UNKNOWN_ARENA): a client attaches a fresh arena (the daemon restarted, or dropped it)
UNKNOWN_ARENA = "unknown arena"
STREAM, ARENA, CALLER_MEMORY = "stream", "arena", "caller memory"
# the start of the daemon's answer to a load whose chunks do not fit the caller's arena, before it
# wrote any (Retry.ARENA_TOO_SMALL, the bytes it needs typed beside it): the client grows its arena
# (up to its limit) and asks again
ARENA_TOO_SMALL = "the arena is too small for this load"


class Piece(NamedTuple):
    """One message's worth of a batch: stream bytes (views of the blobs, joined only into the
    message that carries them) and the indices of the blobs that start in them, or the handle of the
    blobs placed in the arena."""

    parts: Sequence[Blob] = ()
    indices: Sequence[int] = ()
    handle: pb.ShmHandle | None = None

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)

    def encoded(self) -> list[Blob]:
        """A stream piece as the pieces of a serialized ChunkData (kvstore/transport/fastpb.py)."""
        return fastpb.chunk_data(self.parts, self.indices)

    def into(self, msg: pb.ChunkData) -> pb.ChunkData:
        """Fill ``msg``: a fresh ChunkData or the field of an outer message. (Building the outer
        message from a finished ChunkData would copy the data once more: 0.26 ms per 512 KiB.)"""
        if self.handle is not None:
            msg.shm.CopyFrom(self.handle)
        else:
            msg.data = self.data
            msg.indices.extend(self.indices)
        return msg

    def message(self) -> pb.ChunkData:
        return self.into(pb.ChunkData())


class Carrier(ABC):
    """How one batch of chunk blobs travels. ``arena_id`` names the arena in requests ("" = none)."""

    name: ClassVar[str]
    arena_id: str = ""

    def __init__(self, message_bytes: int = framing.DEFAULT_MESSAGE_BYTES) -> None:
        self.message_bytes = message_bytes

    @abstractmethod
    def send(self, items: Iterable[tuple[int, Blob]]) -> Generator[Piece, None, None]:
        """The batch, one piece per message, produced lazily in index order (a miss is simply left out)."""

    def receiver(self, copy: bool = True) -> Receiver:
        """Reads this carrier's messages. ``copy=False``: blobs may be views into the arena, valid
        until the carrier's next batch."""
        return Receiver(None, copy)

    def stream(self, items: Iterable[tuple[int, Blob]]) -> Generator[Piece, None, None]:
        index: list[int] = []

        def blobs() -> Iterator[Blob]:
            for i, b in items:
                index.append(i)
                yield b

        for parts, starts in framing.pack(blobs(), self.message_bytes):
            yield Piece(parts, [index[s] for s in starts])


class StreamCarrier(Carrier):
    name = STREAM

    def send(self, items: Iterable[tuple[int, Blob]]) -> Generator[Piece, None, None]:
        return self.stream(items)


class ArenaCarrier(Carrier):
    """Blobs copied back to back into ``arena`` from offset 0; what does not fit takes the stream."""

    name = ARENA

    def __init__(self, arena: shm.ArenaMemory, arena_id: str,
                 message_bytes: int = framing.DEFAULT_MESSAGE_BYTES) -> None:
        super().__init__(message_bytes)
        self.arena = arena
        self.arena_id = arena_id
        self.overflowed = False  # the last batch did not fit whole (the daemon counts these)

    def send(self, items: Iterable[tuple[int, Blob]]) -> Generator[Piece, None, None]:
        self.overflowed = False
        handle = pb.ShmHandle(arena_id=self.arena_id)
        arena, off = self.arena, 0
        it = iter(items)
        for i, blob in it:
            n = len(blob)
            if off + n > self.arena.size:
                self.overflowed = True
                if handle.indices:
                    handle.size = off
                    yield Piece(handle=handle)
                yield from self.stream(_chain((i, blob), it))
                return
            arena.write(off, blob)
            handle.indices.append(i)
            handle.offsets.append(off)
            handle.sizes.append(n)
            off += n
        if handle.indices:
            handle.size = off
            yield Piece(handle=handle)

    def receiver(self, copy: bool = True) -> Receiver:
        return Receiver(self, copy)


class CallerMemoryCarrier(Carrier):
    """Daemon side of a load into the caller's memory: blobs written back to back from the start of
    [address, address + size) of the process that sent the request (``sender``, named by the kernel
    on the request's own messages: kvstore/transport/sender.py; never a pid a request names, nor one
    remembered from the connect), ``cma.MAX_IOV`` blobs a system call, each while the tier's bytes
    are still in hand."""

    name = CALLER_MEMORY

    def __init__(self, sender: Sender, address: int, size: int) -> None:
        super().__init__()
        self.sender, self.address, self.size = sender, address, size

    def send(self, items: Iterable[tuple[int, Blob]]) -> Generator[Piece, None, None]:
        batch = list(items)  # held until written: the tier's bytes, alive while listed here
        sizes = np.fromiter((len(b) for _, b in batch), np.uint64, len(batch))
        offsets = np.zeros(len(batch), np.uint64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        end = int(offsets[-1] + sizes[-1]) if batch else 0
        if end > self.size:
            fit = int(np.searchsorted(offsets + sizes, self.size, side="right"))
            raise ResourceExhausted(f"the destination holds {self.size} bytes; this load needs {end} "
                                    f"(chunk {batch[fit][0]} does not fit)", reason=Retry.CALLER_MEMORY_TOO_SMALL,
                                    needed_bytes=end)
        sources = np.stack([chunk_batch.addresses([b for _, b in batch]), sizes], axis=1) if batch else sizes
        self._write(sources, offsets)
        if batch:
            yield Piece(handle=pb.ShmHandle(caller_memory=True, size=end, indices=[i for i, _ in batch],
                                            offsets=offsets.tolist(), sizes=sizes.tolist()))

    def _write(self, sources: np.ndarray, offsets: np.ndarray) -> None:
        with caller_memory_errors(self.address, self.size), self.sender.reaching() as pid:
            cma.write(pid, sources, self.address, self.size, offsets)


@contextlib.contextmanager
def caller_memory_errors(address: int, size: int, access: str = "writable") -> Iterator[None]:
    """A cross-memory copy with the caller as the domain errors it answers: memory the caller named but
    has not mapped (EFAULT) is INVALID_ARGUMENT; a kernel that refuses the copy (EPERM, ENOSYS)
    FAILED_PRECONDITION, CALLER_MEMORY_REFUSED (the client goes through its arena or the stream)."""
    try:
        yield
    except cma.CrossMemoryError as e:
        if e.errno == errno.EFAULT:  # the caller named memory it has not mapped: its mistake
            raise InvalidArgument(f"CallerMemory [{address:#x}, +{size}) is not {access} memory of the calling "
                                  f"process") from e
        raise FailedPrecondition(f"{CALLER_MEMORY_REFUSED}: {e.strerror}; go through the arena or the "
                                 f"stream instead", reason=Retry.CALLER_MEMORY_REFUSED) from e


class CallerSlotsCarrier(CallerMemoryCarrier):
    """Daemon side of a scatter load of engine pages into the caller's slots (kvstore/transport/slots.py):
    each verified page blob's payload, the engine's block bytes, written at its key's slot, in its
    key's region (one region, or several: ``LoadChunksRequest.more_into``), all of a batch's in
    ``cma.MAX_IOV`` iovecs a system call (large batches over threads: ``cma.write``), whichever
    regions they go to. A blob that is not a page blob of this version is a miss (its slot untouched);
    a payload longer than its slot fails the call before any byte is written."""

    def __init__(self, sender: Sender, where: slots.Scatter) -> None:
        super().__init__(sender, *where.hull)
        self.where = where

    def send(self, items: Iterable[tuple[int, Blob]]) -> Generator[Piece, None, None]:
        batch: list[tuple[int, Blob, int, int]] = []  # (index, blob, payload offset, payload length)
        for i, blob in items:  # the blobs, held until written: the tier's bytes, alive while listed here
            try:
                at, n = page.payload_span(blob)
            except page.PageError:
                continue  # a chunk, or a page blob of another version: no payload to place
            batch.append((i, blob, at, n))
        if not batch:  # answered all the same: the call was served (every key a miss), not refused
            yield Piece(handle=pb.ShmHandle(caller_memory=True))
            return
        which = np.fromiter((i for i, *_ in batch), np.intp, len(batch))
        sizes = np.fromiter((n for *_, n in batch), np.uint64, len(batch))
        limits = self.where.slot_bytes[which]
        if (long := sizes > limits).any():
            k = int(np.argmax(long))
            raise InvalidArgument(f"key {int(which[k])}'s block is {int(sizes[k])} bytes; CallerMemory.slot_bytes "
                                  f"is {int(limits[k])}")
        starts = chunk_batch.addresses([b for _, b, _, _ in batch]) + np.fromiter((a for *_, a, _ in batch), np.uint64,
                                                                                  len(batch))
        self._write(np.stack([starts, sizes], axis=1), self.where.addresses[which])
        offsets = self.where.offsets[which]
        yield Piece(handle=pb.ShmHandle(caller_memory=True, size=int((offsets + sizes).max()),
                                        indices=which.tolist(), offsets=offsets.tolist(), sizes=sizes.tolist()))

    def _write(self, sources: np.ndarray, addresses: np.ndarray) -> None:
        """Each source at its absolute address (every slot was checked inside its region: slots.scatter)."""
        with caller_memory_errors(self.address, self.size), self.sender.reaching() as pid:
            cma.write(pid, sources, 0, 1 << 64, addresses)


def _private_copy(view: Blob, buffer_for: Callable[[int], memoryview | None] | None) -> Blob:
    """A copy of ``view`` nobody else can change: in a lent buffer (read-only from here on), or bytes."""
    buf = buffer_for(len(view)) if buffer_for is not None else None
    if buf is None:
        return bytes(view)
    buf[:] = view
    return buf.toreadonly()


def _chain(first: tuple[int, Blob], rest: Iterator[tuple[int, Blob]]) -> Iterator[tuple[int, Blob]]:
    yield first
    yield from rest


class Receiver:
    """Turns the ChunkData messages of one batch into (index, blob) pairs, whichever way each came."""

    def __init__(self, arena: ArenaCarrier | None, copy: bool, max_blob: int | None = None,
                 into: memoryview | None = None, regions: Sequence[memoryview] = (),
                 region_of: Sequence[int] | None = None) -> None:
        self.arena = arena
        self.copy = copy
        self.into = into  # a load into the caller's memory: the blobs are views of it
        # ... or into several regions of it (LoadChunksRequest.more_into): key i's blob is a view of
        # regions[region_of[i]], at the offset the answer names within that region
        self.regions, self.region_of = regions, region_of
        self.assembler = framing.BlobAssembler() if max_blob is None else framing.BlobAssembler(max_blob)
        self.pending: list[int] = []

    def feed(self, msg: pb.ChunkData | fastpb.StreamChunks) -> list[tuple[int, Blob]]:
        if isinstance(msg, pb.ChunkData) and msg.HasField("shm"):
            h = msg.shm
            if h.caller_memory:
                return self._placed(h)
            if self.arena is None or h.arena_id != self.arena.arena_id:
                raise InvalidArgument("the answer names an arena this call did not")
            arena = self.arena.arena
            if any(o + n > arena.size for o, n in zip(h.offsets, h.sizes)):
                raise InvalidArgument("the answer names bytes beyond the arena")
            if self.copy:
                return [(i, arena.read(o, n)) for i, o, n in zip(h.indices, h.offsets, h.sizes)]
            if not isinstance(arena, shm.Arena):
                raise InvalidArgument("zero-copy reads need a mapped arena")
            view = arena.view
            return [(i, view[o : o + n]) for i, o, n in zip(h.indices, h.offsets, h.sizes)]
        self.pending.extend(msg.indices)
        blobs = self.assembler.feed(msg.data)
        out = list(zip(self.pending[: len(blobs)], blobs))
        del self.pending[: len(blobs)]
        return out

    def _placed(self, h: pb.ShmHandle) -> list[tuple[int, Blob]]:
        """The blobs the daemon wrote into the caller's memory, as views of it."""
        if self.region_of is not None:
            return self._placed_in_regions(h)
        into = self.into
        if into is None:
            raise InvalidArgument("the answer names the caller's memory, which this call did not")
        if any(o + n > len(into) for o, n in zip(h.offsets, h.sizes)):
            raise InvalidArgument("the answer names bytes beyond the destination")
        return [(i, into[o : o + n]) for i, o, n in zip(h.indices, h.offsets, h.sizes)]

    def _placed_in_regions(self, h: pb.ShmHandle) -> list[tuple[int, Blob]]:
        of, regions, out = self.region_of, self.regions, []
        assert of is not None
        for i, o, n in zip(h.indices, h.offsets, h.sizes):
            if i >= len(of):
                raise InvalidArgument("the answer names a key the call did not")
            dest = regions[of[i]]
            if o + n > len(dest):
                raise InvalidArgument("the answer names bytes beyond the destination")
            out.append((i, dest[o : o + n]))
        return out

    def arena_prefix(self, size: int, buffer_for: Callable[[int], memoryview | None] | None = None) -> list[Blob]:
        """A save's arena part, the first ``size`` bytes of the arena: copied out before anything
        reads it (the sender can still write to its arena, and what is verified must be exactly
        what is stored), then cut into blobs. ``buffer_for(n)``: where to copy an n-byte blob (the
        store's fastest tier lends the buffer it then keeps: ``TieredStore.buffer_for``); None from
        it, or no ``buffer_for``, and the copy is a bytes object of its own."""
        if self.arena is None:
            raise InvalidArgument("this call names no arena")
        if size > self.arena.arena.size:
            raise InvalidArgument(f"arena_bytes {size} exceeds the arena's {self.arena.arena.size}")
        whole = framing.BlobAssembler(self.assembler.max_blob)  # the arena part holds whole blobs
        spans = whole.feed(self.arena.arena.contents(size))  # each size read once
        whole.finish()
        # one private copy per blob (a tier may keep it as it is: tiers/host/tier.py); a sender that rewrote a
        # header meanwhile gets a copy whose own header disagrees with its length: refused as corrupt
        return [_private_copy(v, buffer_for) for v in spans]

    def blobs(self, data: Blob) -> list[Blob]:
        """A save's streamed part: blobs without indices (they are consecutive)."""
        return self.assembler.feed(data)

    def finish(self) -> None:
        self.assembler.finish()


def same_host_dir(host_id: str, shm_dir: str) -> Path | None:
    """The daemon's shm directory when it runs on this host and we can create files there."""
    d = Path(shm_dir) if shm_dir else None
    if d is None or host_id != shm.host_id() or not d.is_dir() or not os.access(d, os.W_OK):
        return None
    return d
