"""Tenants and page sessions: which namespace a vLLM request's blocks live in, and the page
session (a manifest naming the blocks) each store job's blobs are saved under, in one durable
transaction per turn."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvstore.errors import FailedPrecondition, NotFound
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest, Retention

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import ReqContext

    from kvstore.client import Client
    from kvstore.client.calls import SavedSession
    from kvstore.format.page_layout import PageLayout

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:\-]")
#: Page sessions whose keys a tier remembers (older ones are read back from the daemon when saved again).
MAX_SESSIONS = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class Tenant:
    namespace: str
    token: str = ""


@dataclass
class PageSession:
    """A page session as this tier last saved it: every block key it names, in the order saved.

    A session only grows: each save names everything the last one did plus the new blocks, so a
    turn whose prefix stayed in vLLM's CPU tier (and was never looked up here) frees nothing. The
    first save in this process starts from the daemon's version, if there is one."""

    tenant: Tenant
    session_id: str
    held: dict[bytes, int] = field(default_factory=dict)  # page key -> end token (0: not known here)
    loaded: bool = False  # the daemon's version was read
    version: int = 0  # the version last saved or read: the base of the next save, whichever thread makes it
    lock: threading.Lock = field(default_factory=threading.Lock)  # one turn save at a time


class Sessions:
    """The tier's tenants and the page sessions of its requests (scheduler and job threads both
    reach them)."""

    def __init__(self, layout: PageLayout, default: Tenant, tenants: dict[str, Tenant], retention: Retention) -> None:
        self.layout = layout
        self.default = default
        self.tenants = tenants
        self.retention = retention
        #: each request's page session; None: its tenant is unknown, it is never offloaded
        self._requests: dict[str, PageSession | None] = {}
        self._sessions: OrderedDict[tuple[Tenant, str], PageSession] = OrderedDict()  # the most recent MAX_SESSIONS
        self._lock = threading.Lock()

    def tenant(self, ctx: ReqContext) -> Tenant | None:
        """The tenant of a request (None: an unknown salt, never offloaded)."""
        params = ctx.kv_transfer_params or {}
        salt = params.get("kvstore_tenant") or params.get("cache_salt")
        if not salt:
            return self.default
        return self.tenants.get(str(salt))

    def of_request(self, ctx: ReqContext) -> PageSession | None:
        """The page session of a request (None: not offloaded), made at its first sight."""
        if ctx.req_id not in self._requests:
            params = ctx.kv_transfer_params or {}
            tenant = self.tenant(ctx)
            sid = session_id(str(params.get("kvstore_session") or f"vllm-{ctx.req_id}"))
            self._requests[ctx.req_id] = self._session(tenant, sid) if tenant else None
        return self._requests[ctx.req_id]

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def _session(self, tenant: Tenant, sid: str) -> PageSession:
        with self._lock:
            s = self._sessions.get((tenant, sid))
            if s is None:
                s = self._sessions[(tenant, sid)] = PageSession(tenant, sid)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end((tenant, sid))
            return s

    def save(self, client: Client, s: PageSession, pkeys: list[bytes], blobs: Sequence[T],
             ends: list[int | None], send: Callable[[Manifest, list[T], int], SavedSession] | None = None) -> None:
        """One turn save of the session: the new blobs and the manifest naming all it held before.
        ``send(manifest, the new ones of blobs, base)`` saves them (default: ``client.save_session``;
        the blobs may be what the daemon reads them from: transfer.py)."""
        save = send or client.save_session
        with s.lock:  # a session's turns are saved one after another: each names all the last one did
            for attempt in range(2):
                if not s.loaded:
                    self._catch_up(client, s)
                new = {pk: (end or 0) for pk, end in zip(pkeys, ends) if pk not in s.held}
                fresh = [b for pk, b in zip(pkeys, blobs) if pk in new]
                tokens = max([0, *s.held.values(), *new.values()])
                m = Manifest(s.session_id, s.tenant.namespace, self.layout.layout_id, tokens, 0,
                             (*s.held, *new), b"", (), retention=self.retention,
                             metadata={"engine": "vllm", "model": self.layout.name}, kind=Kind.ENGINE_PAGES)
                try:
                    s.version = save(m, fresh, s.version).manifest.generation  # type: ignore[arg-type]
                except FailedPrecondition:  # saved meanwhile through another engine or daemon: merge, once
                    if attempt:
                        raise
                    s.loaded = False
                    continue
                s.held.update(new)
                return

    def _catch_up(self, client: Client, s: PageSession) -> None:
        """Start from the daemon's version of the session, if it has one."""
        try:
            m, _ = client.get_session(s.tenant.namespace, s.session_id)
        except NotFound:
            m = None
        if m is not None and m.layout_id != self.layout.layout_id:  # never clobber another kind of session
            raise FailedPrecondition(f"session {s.session_id!r} of namespace {s.tenant.namespace!r} holds another "
                                     f"layout's data ({m.layout_id.hex()}): its blocks are not saved under it")
        s.version = m.generation if m is not None else 0
        if m is not None:
            s.held = {**dict.fromkeys(m.chunk_keys, 0), **s.held}
            if m.chunk_keys:
                s.held[m.chunk_keys[-1]] = max(s.held[m.chunk_keys[-1]], m.token_count)
        s.loaded = True


def block_key(layout: PageLayout, tenant: Tenant, group: int, block_hash: bytes) -> bytes:
    """The kvstore key of a vLLM block: its tenant's namespace, the engine's layout and the block hash."""
    return page.page_key(layout.layout_id, tenant.namespace, group, block_hash)


def session_id(raw: str) -> str:
    """A kvstore session id from a request's: unsafe characters replaced, at most 128, starting
    with a letter or digit."""
    sid = _UNSAFE.sub("_", raw)[:127]
    return sid if sid[:1].isalnum() else f"s{sid}"[:128]
