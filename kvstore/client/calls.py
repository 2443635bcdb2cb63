"""The request/answer plumbing of ``Client``: the requests a save sends, how a load's answer is read,
the status -> exception mapping (with the typed retry reason the daemon put beside the status:
kvstore/transport/retry.py) and the retry policy, the session versions a save names as its
base, and the choice of carrier from what the daemon says when the client connects."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvstore.client.config import ClientConfig
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvstoreError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Retry,
    Unauthenticated,
    Unavailable,
)
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Manifest
from kvstore.format.turn_record import Append
from kvstore.transport import convert, fastpb, framing, retry
from kvstore.transport.carrier import Piece, Receiver, StreamCarrier, same_host_dir
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb

ARENA_REATTACH_S = 240.0  # below the daemon's idle limit for arenas (server/carriers.py)
DETACH_TIMEOUT_S = 2.0  # a closing client does not wait long for a daemon that is gone

_ERRORS: dict[grpc.StatusCode, type[KvstoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


class SavedSession(NamedTuple):
    """A turn saved in one call: the new chunks' keys, how many were new, the committed manifest (None
    for a turn saved as an ``Append``: the daemon answers its version only) and its version."""

    keys: list[bytes]
    written: int
    manifest: Manifest | None
    generation: int = 0


# -- statuses and retries ------------------------------------------------------------------------------
def domain_error(e: grpc.RpcError) -> KvstoreError:
    """The exception a status raises here: its code's class, its message, and the typed retry reason
    the daemon sent beside it (``reason``, ``needed_bytes``), which alone decides a retry."""
    code = e.code()  # type: ignore[attr-defined]
    cls = _ERRORS.get(code, KvstoreError)
    details = e.details()  # type: ignore[attr-defined]
    trailing = getattr(e, "trailing_metadata", None)
    reason, needed = retry.decode(trailing() if trailing is not None else None)
    return cls(f"daemon unavailable: {details}" if code == grpc.StatusCode.UNAVAILABLE else f"{details}",
               reason=reason, needed_bytes=needed)


def unknown_arena(err: KvstoreError) -> bool:
    """The daemon does not know the arena we named: it restarted, or unmapped it when idle."""
    return isinstance(err, InvalidArgument) and err.reason == Retry.UNKNOWN_ARENA


def arena_too_small(err: KvstoreError) -> int:
    """The bytes a load needs that did not fit our arena (the daemon wrote none of it), else 0."""
    return err.needed_bytes if isinstance(err, ResourceExhausted) and err.reason == Retry.ARENA_TOO_SMALL else 0


def caller_memory_refused(err: KvstoreError) -> bool:
    """The daemon cannot write into (or read from) this process: go through the arena or the stream."""
    return isinstance(err, FailedPrecondition) and err.reason == Retry.CALLER_MEMORY_REFUSED


def caller_memory_too_small(err: KvstoreError) -> int:
    """The bytes a load into our memory needs that did not fit the buffer named (none written), else 0."""
    return err.needed_bytes if isinstance(err, ResourceExhausted) and err.reason == Retry.CALLER_MEMORY_TOO_SMALL else 0


def retryable(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def backoff(cfg: ClientConfig, attempt: int) -> float:
    return cfg.backoff_s * (2**attempt) * (0.5 + random.random())


# -- session versions ----------------------------------------------------------------------------------
class Versions:
    """The version (``Manifest.generation``) of each session a client last saved or loaded: the base its
    next save of that session names, so that a save over a version another client wrote since fails
    whole (FAILED_PRECONDITION) instead of silently replacing it. A session this client never saved
    or loaded has no base: its save replaces whatever is stored, as before versions."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], int] = {}
        #: The manifest of that version, when this client has it whole: a save that extends it is sent
        #: as an append (``extends``), O(the turn) on the wire.
        self._last: dict[tuple[str, str], Manifest] = {}
        self._lock = threading.Lock()

    def saw(self, m: Manifest) -> Manifest:
        """Note the version of a manifest the daemon answered with (a save, a load, a read)."""
        with self._lock:
            ref = (m.namespace, m.session_id)
            if m.generation:
                self._seen[ref], self._last[ref] = m.generation, m
            else:  # written before version stamps: no base to name
                self._seen.pop(ref, None)
                self._last.pop(ref, None)
        return m

    def saw_version(self, namespace: str, session_id: str, generation: int) -> None:
        """Note a version the daemon answered by its stamp alone (an append): its manifest is not known here."""
        with self._lock:
            self._seen[(namespace, session_id)] = generation
            self._last.pop((namespace, session_id), None)

    def forget(self, namespace: str, session_id: str) -> None:
        with self._lock:
            self._seen.pop((namespace, session_id), None)
            self._last.pop((namespace, session_id), None)

    def extends(self, m: Manifest, new_blobs: int, base: int | None) -> Append | None:
        """``m`` as an append to the version this client last saved or loaded of its session, if it is
        one: that version is its base (``base`` None or that version's stamp), and ``m`` names its
        chunks, then more (the ``new_blobs`` among them), with the same layout, kind, retention and
        metadata. None: ``m`` is saved whole."""
        with self._lock:
            last = self._last.get((m.namespace, m.session_id))
        if last is None or base not in (None, last.generation):
            return None
        n = len(last.chunk_keys)
        if (len(m.chunk_keys) - new_blobs < n or last.layout_id != m.layout_id or last.kind is not m.kind
                or last.chunk_tokens != m.chunk_tokens or last.retention != m.retention
                or last.metadata != m.metadata or m.chunk_keys[:n] != last.chunk_keys):
            return None
        return Append(m.namespace, m.session_id, m.layout_id, last.generation, m.chunk_keys[n:], m.token_count,
                      m.tail, m.last_token_ids)

    def based(self, m: Manifest, base: int | None) -> Manifest:
        """``m`` as a save sends it: its generation is ``base`` if given (0: no base), else the version
        this client last saved or loaded of that session (whatever generation ``m`` carried: a
        manifest read from one session and saved as another must not name the first one's version)."""
        if base is None:
            with self._lock:
                base = self._seen.get((m.namespace, m.session_id), 0)
        if base < 0:
            raise InvalidArgument(f"a base version is >= 0 (0: none), got {base}")
        return replace(m, generation=base)


# -- connecting: which carrier ---------------------------------------------------------------------
@dataclass(frozen=True)
class PageSlots:
    """Engine pages in one region of the caller's memory (``Client.save_page_regions``): block i, of
    ``groups[i]`` with the engine's hash ``block_hashes[i]``, is its group's ``block_bytes`` at
    ``out[offsets[i]:]``, each slot ``slot_bytes`` long."""

    out: Any
    offsets: Sequence[int]
    slot_bytes: int
    groups: Sequence[int]
    block_hashes: Sequence[bytes]


@dataclass(frozen=True)
class PageLoad:
    """Engine pages to load into one region of the caller's memory (``Client.load_page_regions``): the
    block bytes of ``keys[i]`` go to ``out[offsets[i]:]``, each slot ``slot_bytes`` long."""

    out: Any
    keys: Sequence[bytes]
    offsets: Sequence[int]
    slot_bytes: int


@dataclass(frozen=True)
class Connection:
    """What a client learned when it connected, and the arena it should offer (if any)."""

    info: pb.ServerInfo
    arena_dir: Path | None  # create an arena here and attach it; None = the stream
    message_bytes: int

    def stream(self) -> StreamCarrier:
        return StreamCarrier(self.message_bytes)


def connection(info: pb.ServerInfo, cfg: ClientConfig) -> Connection:
    d = same_host_dir(info.host_id, info.shm_dir) if cfg.shared_memory and cfg.arena_bytes > 0 else None
    return Connection(info, d, min(framing.DEFAULT_MESSAGE_BYTES, info.max_message_bytes // 2))


# -- a save's requests ---------------------------------------------------------------------------------
def save_header(namespace: str, layout_id: bytes, parent: bytes, first_index: int) -> pb.SaveHeader:
    return pb.SaveHeader(namespace=namespace, layout_id=layout_id, parent_key=parent, first_index=first_index)


def turn_header(manifest: Manifest, new_chunks: int) -> pb.SaveHeader:
    """A turn: the manifest's last ``new_chunks`` chunks are sent, then the manifest is committed."""
    first = len(manifest.chunk_keys) - new_chunks
    if first < 0:
        raise InvalidArgument(f"{new_chunks} new chunks, but the manifest names {len(manifest.chunk_keys)}")
    h = save_header(manifest.namespace, manifest.layout_id, manifest.chunk_keys[first - 1] if first else ROOT, first)
    h.commit.CopyFrom(convert.session_to_pb(manifest))
    return h


def append_header(a: Append, new_chunks: int, first: int, parent: bytes) -> pb.SaveHeader:
    """A turn named by what it adds: its last ``new_chunks`` keys are sent as blobs, the first of them
    chunk ``first`` of the session (after ``parent``; engine pages have no place: any)."""
    if new_chunks > len(a.chunk_keys):
        raise InvalidArgument(f"{new_chunks} new chunks, but the append names {len(a.chunk_keys)}")
    h = save_header(a.namespace, a.layout_id, parent, first)
    h.append.CopyFrom(convert.append_to_pb(a))
    return h


def save_requests(header: pb.SaveHeader, pieces: Iterator[Piece]) -> Iterator[pb.SaveChunksRequest]:
    """The header (naming the arena part of the batch, if any), then the streamed part."""
    h = pb.SaveHeader()
    h.CopyFrom(header)
    first = next(pieces, None)
    if first is not None and first.handle is not None:
        h.arena_id, h.arena_bytes = first.handle.arena_id, first.handle.size
        first = None
    yield pb.SaveChunksRequest(header=h, data=first.data if first is not None else b"")
    for p in pieces:
        yield pb.SaveChunksRequest(data=p.data)


# -- a load's answer -----------------------------------------------------------------------------------
ChunksOf = Callable[[Any], pb.ChunkData | fastpb.StreamChunks | None]  # an answer message's chunks


def answer_pairs(head: list[tuple[int, Blob]], stream: Any, receiver: Receiver, chunks_of: ChunksOf, expected: int,
                 tails: set[Any]) -> Iterator[tuple[int, Blob]]:
    """A load answer's (index, blob) pairs: ``head`` (read from its first message), then the rest of
    ``stream``. Once all ``expected`` blobs are in (each index comes at most once), the answer is
    complete: its trailing status is not waited for (~0.5 ms, benchmarks/profile_load.py) but the
    call is kept in ``tails`` until it arrives (a call collected before its status is cancelled, and
    the daemon would count it so); the daemon sends nothing after its last chunk that could change
    what was received."""
    got = len(head)
    yield from head
    try:
        while got < expected:
            msg = next(stream, None)
            if msg is None:
                break
            c = chunks_of(msg)
            if c is not None:
                pairs = receiver.feed(c)
                got += len(pairs)
                yield from pairs
        else:
            receiver.finish()
            tails.add(stream)
            stream.add_done_callback(tails.discard)  # runs at once if the status is already in
            return
        for msg in stream:  # misses: only the end of the stream says there is nothing more
            c = chunks_of(msg)
            if c is not None:
                yield from receiver.feed(c)
    except grpc.RpcError as e:
        raise domain_error(e) from None
    receiver.finish()
