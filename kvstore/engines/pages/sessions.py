"""Tenants and page sessions, for every engine: the namespace an engine's pages live in, and the page
session (a manifest naming the pages) each batch of stored pages is saved under, in one durable
transaction per turn. vLLM's tier maps its requests onto them (``kvstore/engines/vllm/sessions.py``),
SGLang's HiCache backend its conversations (``kvstore/engines/sglang/backend.py``)."""

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
from kvstore.format.turn_record import Append

if TYPE_CHECKING:
    from kvstore.client import Client
    from kvstore.client.calls import SavedSession
    from kvstore.format.page_layout import PageLayout

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:\-]")
#: Page sessions whose keys an engine remembers (older ones are read back from the daemon when saved again).
MAX_SESSIONS = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class Tenant:
    namespace: str
    token: str = ""


@dataclass
class PageSession:
    """A page session as this engine last saved it: every page key it names, in the order saved.

    A session only grows: each save names everything the last one did plus the new pages, so a
    turn whose prefix stayed in the engine's own host cache (and was never looked up here) frees
    nothing. The first save in this process starts from the daemon's version, if there is one."""

    tenant: Tenant
    session_id: str
    held: dict[bytes, int] = field(default_factory=dict)  # page key -> end token (0: not known here)
    loaded: bool = False  # the daemon's version was read
    version: int = 0  # the version last saved or read: the base of the next save, whichever thread makes it
    tokens: int = 0  # the largest end token of its pages: the session's token count
    lock: threading.Lock = field(default_factory=threading.Lock)  # one turn save at a time


class PageSessions:
    """An engine's tenants and page sessions (the engine's scheduling and I/O threads both reach them)."""

    def __init__(self, layout: PageLayout, default: Tenant, retention: Retention) -> None:
        self.layout = layout
        self.default = default
        self.retention = retention
        self._sessions: OrderedDict[tuple[Tenant, str], PageSession] = OrderedDict()  # the most recent MAX_SESSIONS
        self._lock = threading.Lock()

    def session(self, tenant: Tenant, sid: str) -> PageSession:
        """The page session ``sid`` of ``tenant`` (made at its first sight, kept among the most recent)."""
        with self._lock:
            s = self._sessions.get((tenant, sid))
            if s is None:
                s = self._sessions[(tenant, sid)] = PageSession(tenant, sid)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end((tenant, sid))
            return s

    def save(self, client: Client, s: PageSession, pkeys: list[bytes], blobs: Sequence[T],
             ends: list[int | None], send: Callable[[Manifest | Append, list[T], int], SavedSession] | None = None
             ) -> None:
        """One turn save of the session: the new blobs, and what it adds to the version last saved or
        read (an ``Append``: the new keys, the token count and that version as its base, O(the turn) on
        the wire and on disk), or, for the session's first version, the manifest naming them all.
        ``send(manifest or append, the new ones of blobs, base)`` saves them (default:
        ``client.save_session``; the blobs may be what the daemon reads them from: the engine's slots)."""
        save = send or client.save_session
        with s.lock:  # a session's turns are saved one after another: each extends the last one
            for attempt in range(2):
                if not s.loaded:
                    self._catch_up(client, s)
                new = {pk: (end or 0) for pk, end in zip(pkeys, ends) if pk not in s.held}
                fresh = [b for pk, b in zip(pkeys, blobs) if pk in new]
                tokens = max([s.tokens, *new.values()])
                turn: Manifest | Append
                if s.version:
                    turn = Append(s.tenant.namespace, s.session_id, self.layout.layout_id, s.version, tuple(new),
                                  tokens, b"", ())
                else:  # the session's first version (or one saved before version stamps): whole
                    turn = Manifest(s.session_id, s.tenant.namespace, self.layout.layout_id, tokens, 0,
                                    (*s.held, *new), b"", (), retention=self.retention,
                                    metadata={"engine": self.layout.engine, "model": self.layout.name},
                                    kind=Kind.ENGINE_PAGES)
                try:
                    s.version = save(turn, fresh, s.version).generation  # type: ignore[arg-type]
                except FailedPrecondition:  # saved meanwhile through another engine or daemon: merge, once
                    if attempt:
                        raise
                    s.loaded = False
                    continue
                s.held.update(new)
                s.tokens = tokens
                return

    def _catch_up(self, client: Client, s: PageSession) -> None:
        """Start from the daemon's version of the session, if it has one."""
        try:
            m, _ = client.get_session(s.tenant.namespace, s.session_id)
        except NotFound:
            m = None
        if m is not None and m.layout_id != self.layout.layout_id:  # never clobber another kind of session
            raise FailedPrecondition(f"session {s.session_id!r} of namespace {s.tenant.namespace!r} holds another "
                                     f"layout's data ({m.layout_id.hex()}): its pages are not saved under it")
        s.version = m.generation if m is not None else 0
        if m is not None:
            s.held = {**dict.fromkeys(m.chunk_keys, 0), **s.held}
            if m.chunk_keys:
                s.held[m.chunk_keys[-1]] = max(s.held[m.chunk_keys[-1]], m.token_count)
            s.tokens = max(s.tokens, m.token_count)
        s.loaded = True


def block_key(layout: PageLayout, tenant: Tenant, group: int, block_hash: bytes) -> bytes:
    """The kvstore key of an engine's page: its tenant's namespace, the engine's layout, the group and the
    engine's own hash of the page."""
    return page.page_key(layout.layout_id, tenant.namespace, group, block_hash)


def session_id(raw: str) -> str:
    """A kvstore session id from an engine's name for it: unsafe characters replaced, at most 128,
    starting with a letter or digit."""
    sid = _UNSAFE.sub("_", raw)[:127]
    return sid if sid[:1].isalnum() else f"s{sid}"[:128]
