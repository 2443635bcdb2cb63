"""Streamed load answers encoded and decoded by hand in protobuf's wire format, the chunk bytes
copied once on the daemon and not at all in the Python client.

Through protobuf, a streamed message's chunk bytes are copied three times on the daemon's event loop:
joined into one ``bytes``, copied into the ``data`` field, copied again by ``SerializeToString``
(0.46-0.66 ms per MiB, benchmarks/daemon/profile_load.py). Here the store's blobs are joined once, straight
into the serialized message. The result is byte for byte what protobuf writes for the same
``ChunkData`` / ``LoadSessionResponse`` (tests/transport/test_transport.py parses it back and compares), so
every gRPC client, in any language, reads it as usual: nothing in the proto changes.

The Python client reads them back the same way (``parse_chunk_data``, ``parse_load_session``): the
chunk bytes stay a view of the received message, where protobuf copies them when it parses (0.18 ms
per MiB) and again when the field is read (0.10 ms per MiB). Anything but stream bytes and indices
(an arena handle, a field this code does not know) is parsed by protobuf, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from google.protobuf.message import Message

from kvstore.errors import InvalidArgument
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb

# tags: (field number << 3) | wire type 2 (length-delimited)
_DATA = b"\x0a"  # ChunkData.data = 1
_INDICES = b"\x12"  # ChunkData.indices = 2 (packed uint32)
_SESSION = b"\x0a"  # LoadSessionResponse.session = 1
_CHUNKS = b"\x12"  # LoadSessionResponse.chunks = 2


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def chunk_data(parts: Sequence[Blob], indices: Sequence[int]) -> list[Blob]:
    """The pieces of one serialized ``ChunkData`` (data = the parts back to back, and indices),
    not yet joined: the caller joins them once, into the message it sends."""
    size = sum(len(p) for p in parts)
    out: list[Blob] = [_DATA + varint(size), *parts] if size else []
    packed = b"".join(map(varint, indices))
    if packed:
        out += [_INDICES + varint(len(packed)), packed]
    return out


def chunk_data_message(parts: Sequence[Blob], indices: Sequence[int]) -> Encoded:
    return Encoded(b"".join(chunk_data(parts, indices)))


def load_session_message(session: bytes | None, chunks: Sequence[Blob]) -> Encoded:
    """A serialized ``LoadSessionResponse``: the manifest (a serialized ``Session``; None in all
    but the first message) and the pieces of its ``ChunkData`` from :func:`chunk_data`."""
    out: list[Blob] = [_SESSION + varint(len(session)), session] if session is not None else []
    out += [_CHUNKS + varint(sum(len(p) for p in chunks)), *chunks]
    return Encoded(b"".join(out))


class Encoded(Message):
    """A message already serialized. It is a ``Message`` (and sizes itself) so that code which
    measures the messages a handler yields, such as the metrics interceptor, counts its bytes; the
    servicer's response serializer (server/handlers.py) sends ``raw`` as it is."""

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def ByteSize(self) -> int:
        return len(self.raw)

    def SerializeToString(self, **_: object) -> bytes:
        return self.raw


# -- decoding (the Python client) -------------------------------------------------------------------
class StreamChunks(NamedTuple):
    """A ChunkData of stream bytes, parsed without copying them: ``data`` is a view of the message."""

    data: memoryview
    indices: list[int]


class LoadAnswer(NamedTuple):
    """One LoadSessionResponse: the manifest (first message only) and its chunks, if any."""

    session: pb.Session | None
    chunks: pb.ChunkData | StreamChunks | None


class _Unknown(Exception):
    """A field this decoder leaves to protobuf."""


def _varint(mv: memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(mv) or shift > 63:
            raise InvalidArgument("the daemon's answer does not parse: a truncated varint")
        b = mv[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7


def _fields(mv: memoryview) -> Iterator[tuple[int, memoryview | int]]:
    """(field number, a length-delimited field's view or a varint's value) of each field in turn."""
    pos = 0
    while pos < len(mv):
        tag, pos = _varint(mv, pos)
        if tag & 7 == 0:
            value, pos = _varint(mv, pos)
            yield tag >> 3, value
        elif tag & 7 == 2:
            n, pos = _varint(mv, pos)
            if pos + n > len(mv):
                raise InvalidArgument("the daemon's answer does not parse: a field runs past its end")
            yield tag >> 3, mv[pos : pos + n]
            pos += n
        else:
            raise _Unknown


def _stream_chunks(mv: memoryview) -> StreamChunks:
    data, indices = mv[:0], []
    for field, value in _fields(mv):
        if field == 1 and isinstance(value, memoryview):
            data = value
        elif field == 2 and isinstance(value, memoryview):  # packed (what every encoder writes)
            pos = 0
            while pos < len(value):
                i, pos = _varint(value, pos)
                indices.append(i)
        elif field == 2 and isinstance(value, int):
            indices.append(value)
        else:
            raise _Unknown
    return StreamChunks(data, indices)


def parse_chunk_data(raw: bytes) -> pb.ChunkData | StreamChunks:
    """LoadChunks' response deserializer."""
    try:
        return _stream_chunks(memoryview(raw))
    except _Unknown:
        return pb.ChunkData.FromString(raw)


def parse_load_session(raw: bytes) -> LoadAnswer:
    """LoadSession's response deserializer."""
    try:
        session, chunks = None, None
        for field, value in _fields(memoryview(raw)):
            if field == 1 and isinstance(value, memoryview):
                session = pb.Session.FromString(value)
            elif field == 2 and isinstance(value, memoryview):
                chunks = _stream_chunks(value)
            else:
                raise _Unknown
        return LoadAnswer(session, chunks)
    except _Unknown:
        m = pb.LoadSessionResponse.FromString(raw)
        return LoadAnswer(m.session if m.HasField("session") else None, m.chunks if m.HasField("chunks") else None)
