"""The asyncio face of the client: ``AsyncClient``, a facade over one :class:`kvstore.client.Client`.

Every public method of ``Client`` has a counterpart here of the same name, parameters and result,
awaitable: it runs the blocking implementation in a worker thread, so the event loop never waits
on the daemon, and connecting, the carrier, batching and retries exist once (in ``Client``).
A load's iterator becomes an async iterator that pulls its pairs in the worker, a batch of up to
``PULL_BYTES`` per hop. tests/client/test_client_faces.py fails if the two faces drift apart.

Tasks sharing one ``AsyncClient`` share its ``Client``, which is thread-safe: its arena carries one
batch at a time (a task waits for it in its worker, not on the loop). Blobs are copies unless a
load asks for ``zero_copy``, whose views are valid only until this client's next batch, whichever
task makes it. A task cancelled during a call stops waiting for it; its worker finishes the call
(a save may still commit, as one the daemon has received may whenever its caller goes away).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from kvstore.client.calls import PageLoad, PageSlots, SavedSession
from kvstore.client.config import ClientConfig
from kvstore.client.device_load import DeviceLoader
from kvstore.client.sync import Client
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.page_layout import PageLayout
from kvstore.format.turn_record import Append
from kvstore.results import LookupResult, SaveResult
from kvstore.transport.carrier import ARENA, Carrier
from kvstore.transport.framing import Blob
from kvstore.v1 import kvstore_pb2 as pb

T = TypeVar("T")
Pair = tuple[int, Blob]

#: the most blob bytes one hop to the worker brings back (beyond its first pair): a hop costs tens
#: of microseconds, so it is paid per few MiB, not per chunk, yet the loop sees a long answer's
#: first pairs before its last ones have arrived
PULL_BYTES = 4 << 20


class AsyncClient:
    """``AsyncClient(...)`` takes what ``Client(...)`` takes; ``async with`` closes it. ``client``:
    the blocking Client it drives, which may be passed in (``AsyncClient(client=...)``: one Client
    under both faces, its session versions shared); closing the AsyncClient closes that Client."""

    def __init__(self, config: ClientConfig | str | None = None, *, client: Client | None = None,
                 **kwargs: Any) -> None:
        if client is not None and (config is not None or kwargs):
            raise TypeError("give a Client, or what to make one of, not both")
        self.client = client if client is not None else Client(config, **kwargs)
        self.config = self.client.config
        self.address = self.client.address
        # its own workers: a caller's default executor is not filled with calls waiting on the daemon
        self._pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="kvstore-aio")
        self._closed = False

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    async def _pull(self, pairs: Iterator[Pair]) -> AsyncIterator[Pair]:
        """``pairs`` as an async iterator, pulled in the worker. Left early (a break, a cancelled task),
        the blocking iterator is closed in the worker thread once no pull of it is under way."""
        pull: concurrent.futures.Future[tuple[list[Pair], bool]] | None = None
        try:
            done = False
            while not done:
                pull = self._pool.submit(_take, pairs, PULL_BYTES)
                batch, done = await asyncio.wrap_future(pull)
                for pair in batch:
                    yield pair
        finally:
            close = getattr(pairs, "close", None)
            if close is not None:  # a generator: a load's stream, cancelled when closed
                if pull is None:
                    close()
                else:  # runs now if the last pull is over, else in its worker when it is
                    pull.add_done_callback(lambda _: close())

    async def close(self) -> None:
        """As :meth:`Client.close`; then the workers go. Closing twice is closing once."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._run(self.client.close)
        finally:
            self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connecting ---------------------------------------------------------------------------------
    async def connect(self) -> Carrier:
        return await self._run(self.client.connect)

    @property
    def carrier(self) -> Carrier:
        """The carrier chosen when the client connected; RuntimeError before (a property cannot wait
        for the daemon: ``await connect()`` first)."""
        carrier = self.client.carrier_chosen
        if carrier is None:
            raise RuntimeError("not connected yet: await connect() (or any call that moves chunks) first")
        return carrier

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the client chose the arena; False before it connected (never waits on the daemon)."""
        carrier = self.client.carrier_chosen
        return carrier is not None and carrier.name == ARENA

    @property
    def carrier_chosen(self) -> Carrier | None:
        return self.client.carrier_chosen

    async def info(self) -> pb.ServerInfo:
        return await self._run(self.client.info)

    async def health(self) -> str:
        return await self._run(self.client.health)

    # -- chunks -------------------------------------------------------------------------------------
    async def save_chunks(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                          blobs: Iterable[Blob]) -> SaveResult:
        return await self._run(self.client.save_chunks, namespace, layout_id, parent, first_index, blobs)

    async def save_session(self, manifest: Manifest | Append, new_blobs: Sequence[Blob], base: int | None = None
                           ) -> SavedSession:
        return await self._run(self.client.save_session, manifest, new_blobs, base)

    async def append_session(self, append: Append, new_blobs: Sequence[Blob], first_index: int = 0,
                             parent: bytes = ROOT) -> SavedSession:
        return await self._run(self.client.append_session, append, new_blobs, first_index, parent)

    async def load_chunks(self, namespace: str, keys: Sequence[bytes], zero_copy: bool = False
                          ) -> AsyncIterator[Pair]:
        """As :meth:`Client.load_chunks` (``async for``; not awaited)."""
        async for pair in self._pull(self.client.load_chunks(namespace, keys, zero_copy)):
            yield pair

    async def load_session(self, namespace: str, session_id: str, zero_copy: bool = False
                           ) -> tuple[Manifest, AsyncIterator[Pair]]:
        manifest, pairs = await self._run(self.client.load_session, namespace, session_id, zero_copy)
        return manifest, self._pull(pairs)

    async def load_session_into(self, namespace: str, session_id: str, out: Any
                                ) -> tuple[Manifest, list[tuple[int, memoryview]]]:
        return await self._run(self.client.load_session_into, namespace, session_id, out)

    async def load_chunks_into(self, namespace: str, keys: Sequence[bytes], out: Any) -> list[tuple[int, memoryview]]:
        return await self._run(self.client.load_chunks_into, namespace, keys, out)

    async def save_pages(self, manifest: Manifest | Append, layout: PageLayout, out: Any, offsets: Sequence[int],
                         slot_bytes: int, groups: Sequence[int], block_hashes: Sequence[bytes],
                         base: int | None = None) -> SavedSession:
        return await self._run(self.client.save_pages, manifest, layout, out, offsets, slot_bytes, groups,
                               block_hashes, base)

    async def save_page_regions(self, manifest: Manifest | Append, layout: PageLayout, regions: Sequence[PageSlots],
                                base: int | None = None) -> SavedSession:
        return await self._run(self.client.save_page_regions, manifest, layout, regions, base)

    async def load_pages_into(self, namespace: str, keys: Sequence[bytes], out: Any, offsets: Sequence[int],
                              slot_bytes: int) -> list[tuple[int, memoryview]]:
        return await self._run(self.client.load_pages_into, namespace, keys, out, offsets, slot_bytes)

    async def load_page_regions(self, namespace: str, regions: Sequence[PageLoad]
                                ) -> list[list[tuple[int, memoryview]]]:
        return await self._run(self.client.load_page_regions, namespace, regions)

    async def load_session_to_device(self, namespace: str, session_id: str, device: Any = None
                                     ) -> tuple[Manifest, list[tuple[int, Any]]]:
        return await self._run(self.client.load_session_to_device, namespace, session_id, device)

    async def device_loader(self, device: Any = None) -> DeviceLoader:
        """As :meth:`Client.device_loader` (its ``load`` blocks: use :meth:`load_session_to_device`)."""
        return await self._run(self.client.device_loader, device)

    # -- device buffers -----------------------------------------------------------------------------
    async def attach_device_buffer(self, handle: pb.DeviceBufferHandle) -> str:
        return await self._run(self.client.attach_device_buffer, handle)

    async def detach_device_buffer(self, buffer_id: str) -> None:
        await self._run(self.client.detach_device_buffer, buffer_id)

    async def load_session_into_device_buffer(self, namespace: str, session_id: str, buffer_id: str
                                              ) -> pb.LoadSessionToDeviceResponse:
        return await self._run(self.client.load_session_into_device_buffer, namespace, session_id, buffer_id)

    # -- sessions -----------------------------------------------------------------------------------
    async def lookup(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> LookupResult:
        return await self._run(self.client.lookup, namespace, layout_id, token_ids)

    async def commit(self, manifest: Manifest, base: int | None = None) -> Manifest:
        return await self._run(self.client.commit, manifest, base)

    async def get_session(self, namespace: str, session_id: str) -> tuple[Manifest, dict[str, int]]:
        return await self._run(self.client.get_session, namespace, session_id)

    async def list_sessions(self, namespace: str = "") -> list[pb.SessionSummary]:
        return await self._run(self.client.list_sessions, namespace)

    async def delete_session(self, namespace: str, session_id: str) -> int:
        return await self._run(self.client.delete_session, namespace, session_id)

    async def touch_session(self, namespace: str, session_id: str, retention: Retention) -> Manifest:
        return await self._run(self.client.touch_session, namespace, session_id, retention)

    async def stats(self) -> pb.StatsResponse:
        return await self._run(self.client.stats)

    async def namespace_stats(self, namespace: str = "") -> list[pb.NamespaceUsage]:
        return await self._run(self.client.namespace_stats, namespace)

    async def evict(self, namespace: str, session_id: str, tier: str) -> int:
        return await self._run(self.client.evict, namespace, session_id, tier)

    async def prefetch_session(self, namespace: str, session_id: str) -> pb.PrefetchSessionResponse:
        return await self._run(self.client.prefetch_session, namespace, session_id)

    async def prefetch(self, namespace: str, session_id: str) -> int:
        return await self._run(self.client.prefetch, namespace, session_id)

    async def wait_prefetched(self, namespace: str, session_id: str, timeout_s: float = 30.0,
                              poll_s: float = 0.005) -> float | None:
        return await self._run(self.client.wait_prefetched, namespace, session_id, timeout_s, poll_s)

    # -- engines ------------------------------------------------------------------------------------
    async def register_layout(self, definition: bytes, namespace: str = "") -> bytes:
        return await self._run(self.client.register_layout, definition, namespace)

    async def lookup_keys(self, namespace: str, keys: Sequence[bytes]) -> list[str | None]:
        return await self._run(self.client.lookup_keys, namespace, keys)


def _take(pairs: Iterator[Pair], budget: int) -> tuple[list[Pair], bool]:
    """The next pairs, up to ``budget`` blob bytes (at least one pair), and whether ``pairs`` ended."""
    batch: list[Pair] = []
    size = 0
    for pair in pairs:
        batch.append(pair)
        size += pair[1].nbytes if isinstance(pair[1], memoryview) else len(pair[1])
        if size >= budget:
            return batch, False
    return batch, True
