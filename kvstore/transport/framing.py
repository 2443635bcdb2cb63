"""Stream framing: chunk blobs back to back, cut into gRPC messages and cut out of them again.

Each blob states its own length (docs/FORMAT.md, header offset 8), so no sizes travel beside it,
and the receiver cuts blobs out of each message without copying (memoryview slices) unless a
blob spans messages.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from kvstore.errors import InvalidArgument
from kvstore.format import chunk

# Chunk data per stream message. Measured (benchmarks/results/daemon.md, "aio proto" ceilings): a
# grpc.aio server streaming protobuf messages is fastest at 512 KiB and loses half its speed at
# 4 MiB (each message's bytes field is copied whole). Far under gRPC's default 4 MiB receive limit,
# so a stock client in any language, default options, reads the stream.
DEFAULT_MESSAGE_BYTES = 512 << 10
MAX_MESSAGE_BYTES = 16 << 20  # the most either side accepts (a manifest of a very long session)
_TOTAL = struct.Struct("<I")
_MAGICS = (chunk.MAGIC, b"KVPG")  # kvstore/format/page.py's MAGIC (not imported: page.py pulls in numpy)

Blob = bytes | memoryview


def blob_size(head: Blob) -> int:
    """A chunk's (or engine page blob's) total size from its first 12 bytes (magic checked, so
    garbage fails fast); both formats keep it at offset 8."""
    if bytes(head[:4]) not in _MAGICS:
        raise InvalidArgument(f"stream does not start a chunk here (magic {bytes(head[:4])!r})")
    return _TOTAL.unpack_from(head, 8)[0]


class BlobAssembler:
    """Cuts a stream of concatenated chunk blobs into blobs, zero-copy where a blob lies in one message."""

    def __init__(self, max_blob: int = chunk.MAX_CHUNK_BYTES) -> None:
        self.max_blob = max_blob
        self._partial: bytearray | None = None  # a blob spanning messages, being filled
        self._filled = 0
        self._head = b""  # fewer than 12 bytes of a blob's header, carried to the next message

    def feed(self, data: bytes | memoryview) -> list[Blob]:
        out: list[Blob] = []
        mv = memoryview(data)
        pos = 0
        while pos < len(mv):
            if self._partial is not None:
                take = min(len(self._partial) - self._filled, len(mv) - pos)
                self._partial[self._filled : self._filled + take] = mv[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled == len(self._partial):
                    out.append(memoryview(self._partial))
                    self._partial = None
                continue
            if self._head or len(mv) - pos < 12:
                need = 12 - len(self._head)
                self._head += bytes(mv[pos : pos + need])
                pos += min(need, len(mv) - pos)
                if len(self._head) < 12:
                    continue
                self._start_partial(self._head)
                self._head = b""
                continue
            size = self._checked_size(mv[pos : pos + 12])
            if len(mv) - pos >= size:
                out.append(mv[pos : pos + size])
                pos += size
            else:
                self._start_partial(mv[pos : pos + 12], copy_from=mv[pos:])
                pos = len(mv)
        return out

    def _checked_size(self, head: Blob) -> int:
        size = blob_size(head)
        if size > self.max_blob:
            raise InvalidArgument(f"chunk of {size} bytes exceeds the {self.max_blob}-byte limit")
        if size < chunk.HEADER_BYTES + chunk.CHECKSUM_BYTES:
            raise InvalidArgument(f"chunk declares {size} bytes, less than a header")
        return size

    def _start_partial(self, head: Blob, copy_from: Blob | None = None) -> None:
        size = self._checked_size(head)
        self._partial = bytearray(size)
        src = copy_from if copy_from is not None else head
        self._partial[: len(src)] = src
        self._filled = len(src)
        if self._filled == size:  # only possible for a 12-byte head that completes nothing; guard anyway
            raise InvalidArgument("chunk shorter than its header")

    def finish(self) -> None:
        if self._partial is not None or self._head:
            raise InvalidArgument("stream ended in the middle of a chunk (truncated)")


def pack(blobs: Iterable[Blob], max_bytes: int = DEFAULT_MESSAGE_BYTES) -> Iterator[tuple[list[Blob], list[int]]]:
    """Group blobs into messages of at most ``max_bytes``. A blob that fits in a message but not in
    what is left of this one starts the next: only a blob larger than ``max_bytes`` spans messages,
    and the receiver cuts every other blob out of its message without copying it (with blobs cut
    anywhere, 40% of 224 KiB chunks in 512 KiB messages were copied whole into a buffer on arrival).
    Yields (the message's data as views of the blobs, not joined: whoever builds the message joins
    them once, into it; indices of the blobs that start in this message)."""
    parts: list[Blob] = []
    starts: list[int] = []
    size = 0
    for i, blob in enumerate(blobs):
        mv = memoryview(blob)
        if size and size + len(mv) > max_bytes >= len(mv):
            yield parts, starts
            parts, starts, size = [], [], 0
        starts.append(i)
        while len(mv):
            take = min(len(mv), max_bytes - size)
            parts.append(mv[:take])
            size += take
            mv = mv[take:]
            if size >= max_bytes:
                yield parts, starts
                parts, starts, size = [], [], 0
    if parts:
        yield parts, starts
