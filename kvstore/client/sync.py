"""The Python client of the kvstore daemon (blocking, thread-safe); ``kvstore.client.aio.AsyncClient``
is its asyncio face, a facade over this one implementation. Requests are built and answers read
with ``kvstore.client.calls``.

Unary calls retry with exponential backoff on UNAVAILABLE and carry a deadline. Chunk data moves
through one carrier (kvstore/transport/carrier.py), chosen once, when the client connects (its first
``info``, save or load; kvstore/client/link.py): an arena shared with the daemon when it runs on this
host and agrees to map it, else the gRPC stream. A save larger than the arena overflows to the stream
for that call; a load larger than it grows the arena. ``load_session_into`` loads into the caller's
own buffer (kvstore/client/load_into.py); on the daemon's host ``load_session()`` does too, into a buffer
of the client's whose views it hands out (kvstore/client/load_into.py): one copy from the tier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore.client import calls as rq
from kvstore.client import load_into as into
from kvstore.client.calls import PageLoad, PageSlots, SavedSession
from kvstore.client.config import ClientConfig, client_config, metadata, target
from kvstore.client.device_load import DeviceLoader, device_of
from kvstore.client.link import Link
from kvstore.client.load_into import LoadBuffers
from kvstore.errors import InvalidArgument, KvstoreError, ResourceExhausted
from kvstore.format import page
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.page_layout import PageLayout
from kvstore.format.turn_record import Append
from kvstore.results import LookupResult, SaveResult
from kvstore.transport import convert, local_channel, slots
from kvstore.transport.carrier import ARENA, Carrier, Receiver
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

T = TypeVar("T")


class Client:
    """``Client("127.0.0.1:50151", token=...)``, ``Client(address=..., token=...)`` or
    ``Client(ClientConfig(...))``. An address without a port means the daemon's default port, 50151.

    The client remembers the version of each session it saves or loads, and names it as the base
    of its next save of that session: a save over a version another client wrote meanwhile fails
    with FailedPrecondition, the stored version intact (load it again and retry)."""

    def __init__(self, config: ClientConfig | str | None = None, **kwargs: Any) -> None:
        self.config = client_config(config, kwargs)
        self.address = target(self.config.address)
        self._versions = rq.Versions()
        self._metadata = metadata(self.config)
        self._link = Link(self.config, self.address, self._call, self._metadata)
        self._device_loaders: dict[Any, DeviceLoader] = {}  # torch.device -> its loader, made on first use
        self._into_refused = ""  # why the daemon cannot write into this process (then: arena, copy)
        self._ptracer_named_by = 0  # the process that named the daemon its ptracer (not inherited by a fork)
        self._tails: set[Any] = set()  # loads answered whole, their status still on its way (rq.answer_pairs)
        self._buffers = LoadBuffers(self.config.max_arena_bytes)  # where load_session() is answered, same host

    def close(self) -> None:
        """Detach the device buffers and the arena, close the channels."""
        for loader in self._device_loaders.values():
            loader.close()
        self._buffers.close()
        self._link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connecting: the carrier, chosen once (kvstore/client/link.py) --------------------------------
    def connect(self) -> Carrier:
        """Ask the daemon what it is and pick the carrier (once; later calls return it)."""
        return self._link.connect()

    @property
    def carrier(self) -> Carrier:
        return self.connect()

    @property
    def uses_shared_memory(self) -> bool:
        return self.connect().name == ARENA

    @property
    def carrier_chosen(self) -> Carrier | None:
        """The carrier if the client has connected, else None: never connects (nor waits)."""
        return self._link.chosen

    @property
    def _stub(self) -> pb_grpc.KVStoreStub:
        return self._link.stubs.kvstore

    @property
    def _local(self) -> local_channel.LocalChannel | None:
        return self._link.local


    # -- calls ----------------------------------------------------------------------------------------
    def _call(self, fn: Callable[..., T], request: Any) -> T:
        for attempt in range(self.config.retries + 1):
            try:
                return fn(request, timeout=self.config.timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                if not rq.retryable(e) or attempt == self.config.retries:
                    raise rq.domain_error(e) from None
                time.sleep(rq.backoff(self.config, attempt))
        raise AssertionError("unreachable")

    def info(self) -> pb.ServerInfo:
        self.connect()
        assert self._link.conn is not None
        return self._link.conn.info

    def health(self) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._link.channel)
        r = self._call(stub.Check, health_pb2.HealthCheckRequest(service=""))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    # -- chunks ---------------------------------------------------------------------------------------
    def _save(self, header: pb.SaveHeader, blobs: Iterable[Blob]) -> pb.SaveChunksResponse:
        """One SaveChunks call through the carrier. An arena the daemon no longer knows is attached
        afresh, once, and the call repeated (so the blobs are kept for it)."""
        if self.connect().arena_id:
            blobs = list(blobs)
        with self._link.batch() as carrier:
            for attempt in range(2):
                try:
                    return self._stub.SaveChunks(rq.save_requests(header, carrier.send(enumerate(blobs))),
                                                 timeout=self.config.timeout_s, metadata=self._metadata)
                except grpc.RpcError as e:
                    err = rq.domain_error(e)
                    if attempt == 0 and carrier.arena_id and rq.unknown_arena(err):
                        carrier = self._link.reattach()
                        continue
                    raise err from None
        raise AssertionError("unreachable")

    def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                    blobs: Iterable[Blob]) -> SaveResult:
        """Store consecutive complete chunks of one sequence; their keys, and how many were new."""
        r = self._save(rq.save_header(namespace, layout_id, parent, first_index), blobs)
        return SaveResult(list(r.keys), r.written)

    def save_session(self, manifest: Manifest | Append, new_blobs: Sequence[Blob], base: int | None = None
                     ) -> SavedSession:
        """Save a turn in one call: ``new_blobs`` are the manifest's last ``len(new_blobs)`` chunks;
        the daemon stores them and commits the manifest in one durable transaction. If that fails,
        nothing is stored and the previous version of the session stays. ``base``: the version this
        one replaces (default: the one this client last saved or loaded; 0 = replace whatever is
        stored); FailedPrecondition if the session has changed since.

        A manifest that extends the version this client last saved or loaded (its chunks, then more;
        same layout, retention and metadata) is sent as an append: only what the turn adds travels and
        is written (O(the turn)), and the answer is built here from ``manifest`` and the version the
        daemon stamped. An ``Append`` (engine pages: ``PageSessions``) is sent as it is; its answer
        has no manifest (``append_session``)."""
        if isinstance(manifest, Append):
            return self.append_session(manifest, new_blobs)
        a = self._versions.extends(manifest, len(new_blobs), base)
        if a is not None:
            first = len(manifest.chunk_keys) - len(new_blobs)
            r = self._save(rq.append_header(a, len(new_blobs), first, manifest.chunk_keys[first - 1] if first else
                                            ROOT), new_blobs)
            m = self._versions.saw(manifest.stamped(r.generation, r.created_at, r.updated_at))
            return SavedSession(list(r.keys), r.written, m, r.generation)
        m = self._versions.based(manifest, base)
        return self._saved(m, self._save(rq.turn_header(m, len(new_blobs)), new_blobs))

    def append_session(self, append: Append, new_blobs: Sequence[Blob], first_index: int = 0,
                       parent: bytes = ROOT) -> SavedSession:
        """Save a turn named by what it adds to version ``append.base`` (``Append``): the daemon stores
        ``new_blobs`` (the last ``len(new_blobs)`` of ``append.chunk_keys``; of a token chain, chunk
        ``first_index`` of the session after ``parent`` first) and appends the turn in one durable
        transaction, O(the turn) on the wire and on disk. FailedPrecondition, nothing stored, unless
        ``append.base`` is the session's current version. The answer names the new version (no manifest)."""
        return self._saved(append, self._save(rq.append_header(append, len(new_blobs), first_index, parent), new_blobs))

    def _saved(self, turn: Manifest | Append, r: pb.SaveChunksResponse) -> SavedSession:
        """A turn save's answer, its version remembered as the next one's base: a whole save's names the
        committed manifest, an append's only the new version."""
        if isinstance(turn, Append):
            self._versions.saw_version(turn.namespace, turn.session_id, r.generation)
            return SavedSession(list(r.keys), r.written, None, r.generation)
        m = self._versions.saw(convert.session_from_pb(r.session))
        return SavedSession(list(r.keys), r.written, m, m.generation)

    def save_pages(self, manifest: Manifest | Append, layout: PageLayout, out: Any, offsets: Sequence[int],
                   slot_bytes: int, groups: Sequence[int], block_hashes: Sequence[bytes], base: int | None = None
                   ) -> SavedSession:
        """:meth:`save_session` of engine pages read from their slots of ``out`` (an engine's region of
        slots, as :meth:`load_pages_into` names them): block i, of ``groups[i]`` with the engine's hash
        ``block_hashes[i]``, is the group's ``block_bytes`` at ``out[offsets[i]:]``; ``manifest`` names
        their keys (``page.page_key``). On the daemon's host the daemon reads them from ``out`` itself
        and builds the page blobs around them (one copy, into the buffers its memory tier keeps);
        elsewhere, or where the kernel refuses, they are encoded here and sent through the arena or
        the stream. ``manifest`` may be an ``Append`` naming the new keys only (``save_session``)."""
        return self.save_page_regions(manifest, layout, [PageSlots(out, offsets, slot_bytes, groups, block_hashes)],
                                      base)

    def save_page_regions(self, manifest: Manifest | Append, layout: PageLayout, regions: Sequence[PageSlots],
                          base: int | None = None) -> SavedSession:
        """:meth:`save_pages` of pages in several regions of this process's memory (an engine keeping each
        pool of pages in a buffer of its own: SGLang's HiCache host pools), in one call and one commit: the
        new blobs are every region's, in order. InvalidArgument, before anything is sent, for slots outside
        their region or overlapping."""
        srcs = [into.writable(r.out) for r in regions]
        offs = [slots.check(r.offsets, r.slot_bytes, len(src), len(r.groups)) for r, src in zip(regions, srcs)]
        hashes = [[bytes(h) for h in r.block_hashes] for r in regions]
        n = sum(len(r.groups) for r in regions)
        self.connect()  # the stubs bound to the local socket, which the daemon's read needs
        local = self._local
        if local is not None and not self._into_refused and regions:
            self._allow_daemon(local)
            turn = manifest if isinstance(manifest, Append) else self._versions.based(manifest, base)
            h = rq.append_header(turn, n, 0, ROOT) if isinstance(turn, Append) else rq.turn_header(turn, n)
            pages = [pb.CallerPages(region=pb.CallerMemory(address=into.address(src), size=len(src),
                                                           slot_offsets=o.tolist(), slot_bytes=r.slot_bytes),
                                    groups=list(r.groups), block_hashes=hs)
                     for r, src, o, hs in zip(regions, srcs, offs, hashes)]
            h.from_caller.CopyFrom(pages[0])
            h.more_from_caller.extend(pages[1:])
            try:
                return self._saved(turn, self._stub.SaveChunks(iter([pb.SaveChunksRequest(header=h)]),
                                                               timeout=self.config.timeout_s, metadata=self._metadata))
            except grpc.RpcError as e:
                err = rq.domain_error(e)
                if not rq.caller_memory_refused(err):
                    raise err from None
                self._into_refused = str(err)  # remembered: saves and loads through the arena from now on
        blobs = []
        for r, src, o, hs in zip(regions, srcs, offs, hashes):
            for g, block_hash, at in zip(r.groups, hs, o.tolist()):
                spec = layout.group(g)
                if spec is None:
                    raise InvalidArgument(f"layout {layout.layout_hex} has no group {g}")
                key = page.page_key(layout.layout_id, manifest.namespace, g, block_hash)
                blobs.append(page.encode(layout, g, block_hash, key, src[at : at + spec.block_bytes]))
        return self.save_session(manifest, blobs, base)

    def _open(self, rpc: Callable[..., Any], build: Callable[[Carrier], Any], chunks_of: rq.ChunksOf, zero_copy: bool,
              expected: Callable[[Any], int]) -> tuple[Any, Iterator[tuple[int, Blob]]]:
        """Start a load: its first message, and the (index, blob) pairs of the whole answer. The arena
        part of an answer always comes first, so the arena is held only until it has been read.
        ``expected(first)``: how many blobs the answer holds at most (one per requested chunk)."""
        with self._link.batch() as carrier:
            for attempt in range(3):
                receiver = carrier.receiver(copy=not zero_copy)
                try:  # a gRPC call raises at its first message, a local one at once
                    stream = rpc(build(carrier), timeout=self.config.timeout_s, metadata=self._metadata)
                    first = next(stream, None)
                except grpc.RpcError as e:
                    err = rq.domain_error(e)
                    if attempt < 2 and carrier.arena_id and rq.unknown_arena(err):
                        carrier = self._link.reattach()
                        continue
                    if attempt < 2 and carrier.arena_id and (need := rq.arena_too_small(err)):
                        carrier = self._link.grow(need)  # the daemon wrote nothing: asked again, once
                        continue
                    raise err from None
                c = chunks_of(first) if first is not None else None
                n = expected(first) if first is not None else 0
                return first, rq.answer_pairs(receiver.feed(c) if c is not None else [], stream, receiver, chunks_of,
                                              n, self._tails)
        raise AssertionError("unreachable")

    def load_chunks(self, namespace: str, keys: Sequence[bytes], zero_copy: bool = False
                    ) -> Iterator[tuple[int, Blob]]:
        """(index into ``keys``, verified-by-daemon blob) for each hit, in order; misses are skipped.
        ``zero_copy`` (arena): blobs are views into this client's arena, valid only until its next
        load or save; copy what you keep."""
        keys = list(keys)
        _, pairs = self._open(self._link.stubs.load_chunks,
                              lambda c: pb.LoadChunksRequest(namespace=namespace, keys=keys, arena_id=c.arena_id),
                              lambda m: m, zero_copy, lambda _: len(keys))
        yield from pairs

    def load_session(self, namespace: str, session_id: str, zero_copy: bool = False
                     ) -> tuple[Manifest, Iterator[tuple[int, Blob]]]:
        """The manifest, and an iterator of (chunk index, blob) for the chunks the store still has,
        the caller's to keep. On the daemon's host the daemon writes them all into one buffer of this
        client's, and the blobs are read-only views of it (kvstore/client/load_into.py: reused only
        once no view of the last answer is alive); elsewhere they come through the arena or the stream.
        ``zero_copy``: views into the arena, as in :meth:`load_chunks`."""
        if not zero_copy and (whole := self._load_whole(namespace, session_id)) is not None:
            return whole
        first, pairs = self._open(
            self._link.stubs.load_session,
            lambda c: pb.LoadSessionRequest(namespace=namespace, session_id=session_id, arena_id=c.arena_id),
            lambda m: m.chunks, zero_copy, lambda m: len(m.session.chunk_keys) if m.session is not None else 0)
        if first is None or first.session is None:
            raise KvstoreError("the daemon ended LoadSession without the manifest")
        return self._versions.saw(convert.session_from_pb(first.session)), pairs

    def _load_whole(self, namespace: str, session_id: str) -> tuple[Manifest, Iterator[tuple[int, Blob]]] | None:
        """``load_session`` written by the daemon into one buffer of ours (``_into``), or None where the
        daemon cannot write here (then: the arena). A buffer too small for the answer (the daemon wrote
        none of it: CALLER_MEMORY_TOO_SMALL, with the bytes needed) is replaced by one that fits."""
        self.connect()
        if self._local is None or self._into_refused:
            return None
        need = 0
        for attempt in range(3):
            request = pb.LoadSessionRequest(namespace=namespace, session_id=session_id)
            try:
                first, placed = self._into(self._link.stubs.load_session, request, lambda m: m.chunks,
                                           lambda m: len(m.session.chunk_keys) if m.session is not None else 0,
                                           self._buffers.take(need))
            except ResourceExhausted as e:
                if attempt == 2 or not (need := rq.caller_memory_too_small(e)):
                    raise
                continue  # the session grew past the buffer meanwhile: asked again in one that fits
            if first is None:
                return None
            if first.session is None:
                raise KvstoreError("the daemon ended LoadSession without the manifest")
            return self._versions.saw(convert.session_from_pb(first.session)), iter(
                [(i, view.toreadonly()) for i, view in placed])
        raise AssertionError("unreachable")

    def load_session_into(self, namespace: str, session_id: str, out: Any
                          ) -> tuple[Manifest, list[tuple[int, memoryview]]]:
        """Load a session's chunks into ``out`` (a writable C-contiguous buffer: a numpy array, a CPU or
        pinned torch tensor, an engine's KV view), back to back from its start, in order: the manifest
        and (chunk index, view of ``out``) per chunk the store still has. On the daemon's host the
        daemon writes them there itself, one copy from its tier (kvstore/client/load_into.py); elsewhere
        they come through the arena or the stream and are copied in. ResourceExhausted if ``out`` is
        too small (a session of n chunks needs n times the layout's chunk size)."""
        dest = into.writable(out)
        request = pb.LoadSessionRequest(namespace=namespace, session_id=session_id)
        self.connect()  # first: connecting binds the stubs to the local socket, which the daemon's write needs
        first, placed = self._into(self._link.stubs.load_session, request, lambda m: m.chunks,
                                   lambda m: len(m.session.chunk_keys) if m.session is not None else 0, dest)
        if first is None:
            m, pairs = self.load_session(namespace, session_id, zero_copy=True)
            return m, into.copy_into(dest, pairs)
        if first.session is None:
            raise KvstoreError("the daemon ended LoadSession without the manifest")
        return self._versions.saw(convert.session_from_pb(first.session)), placed

    def load_chunks_into(self, namespace: str, keys: Sequence[bytes], out: Any) -> list[tuple[int, memoryview]]:
        """``load_chunks`` into ``out``, as :meth:`load_session_into` loads a session: (index into
        ``keys``, view of ``out``) per hit, packed from ``out``'s start in order."""
        dest, keys = into.writable(out), list(keys)
        self.connect()  # as in load_session_into: the stub is taken after the client chose its channel
        first, placed = self._into(self._link.stubs.load_chunks, pb.LoadChunksRequest(namespace=namespace, keys=keys),
                                   lambda m: m, lambda _: len(keys), dest)
        return placed if first is not None else into.copy_into(dest, self.load_chunks(namespace, keys, zero_copy=True))

    def load_pages_into(self, namespace: str, keys: Sequence[bytes], out: Any, offsets: Sequence[int],
                        slot_bytes: int) -> list[tuple[int, memoryview]]:
        """Engine page blobs (docs/FORMAT.md section 6) into their slots of ``out`` (an engine's region
        of slots: vLLM's CPU primary tier): the block bytes of ``keys[i]`` (its blob's payload, not its
        header or checksum) at ``out[offsets[i]:]``, each slot ``slot_bytes`` long; (index into
        ``keys``, view of that payload in ``out``) per hit. A miss (absent, refused, not a page blob)
        leaves its slot as it was. On the daemon's host the daemon writes them there itself, one copy
        from its tier (kvstore/transport/slots.py); elsewhere they come through the arena or the
        stream, as many at a time as the arena's first size holds (it does not grow for them), are
        checked again (key, checksum) and copied in. InvalidArgument, before any byte is written, for
        slots outside ``out`` or overlapping, or a block longer than its slot (where the client
        copies: before any byte of that batch). The one-region case of :meth:`load_page_regions`."""
        return self.load_page_regions(namespace, [PageLoad(out, keys, offsets, slot_bytes)])[0]

    def load_page_regions(self, namespace: str, regions: Sequence[PageLoad]) -> list[list[tuple[int, memoryview]]]:
        """:meth:`load_pages_into` into several regions of this process's memory in one call (an engine
        keeping each pool of pages in a buffer of its own: SGLang's HiCache host pools): the block bytes of
        ``regions[r].keys[i]`` at ``regions[r].out[regions[r].offsets[i]:]``. Per region, in order, its
        (index into its ``keys``, view of the payload in its ``out``) per hit; a miss leaves its slot as it
        was. On the daemon's host the daemon writes every region's pages itself, in one call
        (``LoadChunksRequest.more_into``); elsewhere they come through the arena or the stream, as for
        :meth:`load_pages_into`. InvalidArgument, before any byte is written, for slots outside their
        region, two slots overlapping (in one region or across two), or a block longer than its slot."""
        dests = [into.writable(r.out) for r in regions]
        runs = [list(r.keys) for r in regions]
        for i, (r, ks) in enumerate(zip(regions, runs)):
            if len(r.offsets) != len(ks) and len(regions) > 1:  # one region: slots.scatter says so
                raise InvalidArgument(f"regions[{i}]: CallerMemory.slot_offsets names {len(r.offsets)} slots for "
                                      f"{len(ks)} keys: one per key")
        keys = [k for ks in runs for k in ks]
        mems = [pb.CallerMemory(address=into.address(d), size=len(d), slot_offsets=r.offsets, slot_bytes=r.slot_bytes)
                for r, d in zip(regions, dests)]
        where = slots.scatter(mems, len(keys), field=lambda i: f"regions[{i}]")
        firsts = np.cumsum([0, *(len(ks) for ks in runs)]).tolist()
        of = np.repeat(np.arange(len(runs)), [len(ks) for ks in runs]).tolist()  # each key's region
        answer: list[list[tuple[int, memoryview]]] = [[] for _ in regions]
        if not keys:
            return answer
        self.connect()  # as in load_session_into: the stub is taken after the client chose its channel
        request = pb.LoadChunksRequest(namespace=namespace, keys=keys)
        first, placed = self._into(self._link.stubs.load_chunks, request, lambda m: m, lambda _: len(keys), dests[0],
                                   mems, dests, of)
        if first is None:  # the daemon cannot write here: through the arena or the stream, then copied
            blob = int(where.slot_bytes.max()) + page.header_bytes(page.MAX_HASH_BYTES) + page.CHECKSUM_BYTES
            per = max(1, self.config.arena_bytes // blob)
            for start in range(0, len(keys), per):
                pairs = self.load_chunks(namespace, keys[start : start + per], zero_copy=True)
                placed += into.copy_into_slots(dests, of, where, keys, ((start + j, b) for j, b in pairs))
        for i, view in placed:
            answer[of[i]].append((i - firsts[of[i]], view))
        return answer

    def _into(self, rpc: Callable[..., Any], request: Any, chunks_of: rq.ChunksOf, expected: Callable[[Any], int],
              dest: memoryview, scatter: Sequence[pb.CallerMemory] = (), regions: Sequence[memoryview] = (),
              region_of: Sequence[int] | None = None) -> tuple[Any, list[tuple[int, memoryview]]]:
        """A load the daemon writes into ``dest`` itself, over its local socket (``scatter``: engine pages
        into slots of regions of this process's memory, ``dest`` the first; with more than one, ``regions``
        are their views and ``region_of`` each key's region): (first message, placed pairs), or (None, [])
        where it cannot (then the caller loads and copies)."""
        self.connect()
        local = self._local
        if local is None or self._into_refused:
            return None, []
        self._allow_daemon(local)
        if scatter:
            request.into.CopyFrom(scatter[0])
            request.more_into.extend(scatter[1:])
        else:
            request.into.CopyFrom(pb.CallerMemory(address=into.address(dest), size=len(dest)))
        receiver = Receiver(None, copy=False, into=dest, regions=regions,
                            region_of=region_of if len(scatter) > 1 else None)
        try:
            stream = rpc(request, timeout=self.config.timeout_s, metadata=self._metadata)
            first = next(stream, None)
        except grpc.RpcError as e:
            err = rq.domain_error(e)
            if rq.caller_memory_refused(err):
                self._into_refused = str(err)  # remembered: this client loads through its arena from now on
                return None, []
            raise err from None
        if first is None:
            return first, []
        c = chunks_of(first)
        placed = rq.answer_pairs(receiver.feed(c) if c is not None else [], stream, receiver, chunks_of,
                                 expected(first), self._tails)
        return first, list(placed)  # type: ignore[arg-type]

    def _allow_daemon(self, local: local_channel.LocalChannel) -> None:
        """Let the daemon write into (and read from) this process under Yama ptrace_scope 1, once per
        process: a forked child names the daemon again (PR_SET_PTRACER is not inherited by a fork)."""
        if self._ptracer_named_by != (pid := os.getpid()):
            into.allow_daemon(local.peer_pid())
            self._ptracer_named_by = pid

    def load_session_to_device(self, namespace: str, session_id: str, device: Any = None
                               ) -> tuple[Manifest, list[tuple[int, Any]]]:
        """The manifest and (chunk index, uint8 tensor on ``device``) per chunk the store still has
        (default device: the current CUDA one). On the same host and GPU as a daemon with an HBM
        tier, copied device to device through CUDA IPC, with no host round trip; otherwise through
        the host path: :meth:`load_session_into` one page-locked host buffer, then one upload
        (kvstore/client/device_load.py; :meth:`device_loader` says which path and why). The tensors
        are views of a reused buffer, valid until the next such load: clone what you keep."""
        return self.device_loader(device).load(namespace, session_id)

    def device_loader(self, device: Any = None) -> DeviceLoader:
        """The loader :meth:`load_session_to_device` uses for ``device``, made once and closed with this
        client: its ``path`` (IPC or HOST) and, for HOST, the ``reason``."""
        dev = device_of(device)
        loader = self._device_loaders.get(dev)
        # setdefault: threads asking at once get one loader (a loader attaches nothing before its first load)
        return loader if loader is not None else self._device_loaders.setdefault(dev, DeviceLoader(self, dev))

    # -- device buffers: the same-GPU handoff's calls, driven by kvstore/client/device_load.py ----------
    def attach_device_buffer(self, handle: pb.DeviceBufferHandle) -> str:
        """Hand the daemon a device buffer exported through CUDA IPC (kvstore/cuda/ipc.py); its buffer
        id. FailedPrecondition if the buffer is not on the daemon's HBM tier's GPU."""
        return self._call(self._stub.AttachDeviceBuffer, pb.AttachDeviceBufferRequest(buffer=handle)).buffer_id

    def detach_device_buffer(self, buffer_id: str) -> None:
        self._call(self._stub.DetachDeviceBuffer, pb.DetachArenaRequest(arena_id=buffer_id))

    def load_session_into_device_buffer(self, namespace: str, session_id: str, buffer_id: str
                                        ) -> pb.LoadSessionToDeviceResponse:
        """The daemon copies the session's chunks device to device into the attached buffer and answers
        their offsets, or ``needed_bytes`` if the buffer is too small (nothing copied). InvalidArgument
        if it does not know the buffer (it restarted)."""
        req = pb.LoadSessionToDeviceRequest(namespace=namespace, session_id=session_id, buffer_id=buffer_id)
        return self._call(self._stub.LoadSessionToDevice, req)

    # -- sessions -------------------------------------------------------------------------------------
    def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        request = pb.LookupRequest(namespace=namespace, layout_id=layout_id, token_ids=list(map(int, token_ids)))
        r = self._call(self._stub.Lookup, request)
        return LookupResult(r.cached_tokens, r.requested_tokens, r.chunks, {t.tier: t.chunks for t in r.tiers})

    def commit(self, manifest: Manifest, base: int | None = None) -> Manifest:
        """Publish a session version whose chunks are all stored; ``base`` as in :meth:`save_session`."""
        req = pb.CommitSessionRequest(session=convert.session_to_pb(self._versions.based(manifest, base)))
        return self._versions.saw(convert.session_from_pb(self._call(self._stub.CommitSession, req).session))

    def get_session(self, namespace: str, session_id: str) -> tuple[Manifest, dict[str, int]]:
        r = self._call(self._stub.GetSession, pb.GetSessionRequest(namespace=namespace, session_id=session_id))
        return self._versions.saw(convert.session_from_pb(r.session)), {t.tier: t.chunks for t in r.tiers}

    def list_sessions(self, namespace: str = "") -> list[pb.SessionSummary]:
        return list(self._call(self._stub.ListSessions, pb.ListSessionsRequest(namespace=namespace)).sessions)

    def delete_session(self, namespace: str, session_id: str) -> int:
        req = pb.DeleteSessionRequest(namespace=namespace, session_id=session_id)
        freed = self._call(self._stub.DeleteSession, req).freed_chunks
        self._versions.forget(namespace, session_id)  # a session saved again under this id is a new one
        return freed

    def touch_session(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        req = pb.TouchSessionRequest(namespace=namespace, session_id=session_id,
                                     retention=convert.retention_to_pb(retention))
        return self._versions.saw(convert.session_from_pb(self._call(self._stub.TouchSession, req).session))

    def stats(self) -> pb.StatsResponse:
        return self._call(self._stub.Stats, pb.StatsRequest())

    def namespace_stats(self, namespace: str = "") -> list[pb.NamespaceUsage]:
        """Usage and quota of ``namespace`` (empty: of every namespace the token covers; an admin's, all)."""
        return list(self._call(self._stub.NamespaceStats, pb.NamespaceStatsRequest(namespace=namespace)).namespaces)

    def evict(self, namespace: str, session_id: str, tier: str) -> int:
        req = pb.EvictSessionRequest(namespace=namespace, session_id=session_id, tier=tier)
        return self._call(self._stub.EvictSession, req).moved_chunks

    def prefetch_session(self, namespace: str, session_id: str) -> pb.PrefetchSessionResponse:
        """Ask the daemon to promote a session's chunks to its fastest tier in the background, ahead
        of a resume; answers at once (chunks queued, already fast, coalesced or dropped)."""
        req = pb.PrefetchSessionRequest(namespace=namespace, session_id=session_id)
        return self._call(self._stub.PrefetchSession, req)

    def prefetch(self, namespace: str, session_id: str) -> int:
        """``prefetch_session``; how many chunks were queued for promotion."""
        return self.prefetch_session(namespace, session_id).queued

    def wait_prefetched(self, namespace: str, session_id: str, timeout_s: float = 30.0,
                        poll_s: float = 0.005) -> float | None:
        """Seconds until every chunk of the session is in the daemon's fastest tier (GetSession polled:
        a measurement helper, e.g. prefetch then this then a timed load), or None if not within
        ``timeout_s`` (a session bigger than that tier never is)."""
        fast, t0 = self.info().tiers[0], time.perf_counter()
        while set(self.get_session(namespace, session_id)[1]) - {fast}:
            if time.perf_counter() - t0 > timeout_s:
                return None
            time.sleep(poll_s)
        return time.perf_counter() - t0

    # -- engines: page layouts and blocks looked up by key (docs/FORMAT.md, "Engine pages") ------------
    def register_layout(self, definition: bytes, namespace: str = "") -> bytes:
        """Register an engine page layout (``kvstore.format.page_layout.PageLayout.definition()``) for
        ``namespace`` (empty: every namespace the token covers; global for an admin token); its id."""
        request = pb.RegisterLayoutRequest(definition=definition, namespace=namespace)
        return bytes(self._call(self._stub.RegisterLayout, request).layout_id)

    def lookup_keys(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        """For each key, the fastest tier holding a copy ``namespace`` saved, or None (one call)."""
        r = self._call(self._stub.LookupKeys, pb.LookupKeysRequest(namespace=namespace, keys=list(keys)))
        return [t or None for t in r.tiers]
