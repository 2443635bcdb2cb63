"""Streamed load answers encoded by hand in protobuf's wire format, the chunk bytes copied once.

Through protobuf, a streamed message's chunk bytes are copied three times on the daemon's event loop:
joined into one ``bytes``, copied into the ``data`` field, copied again by ``SerializeToString``
(0.46-0.66 ms per MiB, benchmarks/profile_load.py). Here the store's blobs are joined once, straight
into the serialized message. The result is byte for byte what protobuf writes for the same
``ChunkData`` / ``LoadSessionResponse`` (tests/test_transport.py parses it back and compares), so
every gRPC client, in any language, reads it as usual: nothing in the proto changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import Message

from kvstore.framing import Blob

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
