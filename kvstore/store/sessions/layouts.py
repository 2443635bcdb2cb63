"""Which layouts a store accepts: kvstore's token layouts (the presets) and the engine page layouts
namespaces registered (``RegisterLayout``), kept durably in the meta keyspace so a restarted
daemon still checks, serves and counts the blocks stored under them.

Per namespace (docs/SECURITY.md, "Page layouts"):

- a page layout is *held* by the namespaces that registered it, and only they may save, commit or
  look up under its id; to any other namespace it is an unknown layout id, exactly as one nobody
  registered. The presets, and a layout registered with no namespace (an admin's, or any caller's
  on a daemon without tokens), are global: every namespace may use them;
- two namespaces registering one definition get one id (its hash: anyone can compute it) and one
  stored definition, each holding it: neither learns that the other does;
- a namespace holds at most ``max_per_namespace`` definitions (global ones count as one more
  namespace's). Registering a definition the namespace already holds answers its id whatever its
  count; a new one past the quota is RESOURCE_EXHAUSTED, whether or not another namespace holds
  that definition, and a new holder always writes the definition with its record, stored before or
  not: the answer and the work are the same either way.

Records: ``L:`` + id -> the canonical definition; ``H:`` + id + namespace -> empty, one per holder
(``H:`` + id alone: global). A definition no holder record names was stored before holders were
kept: it reopens global, as every layout was then.

A registered layout always reopens: what is stored is the canonical form, checked to read back as
the same layout before it is written. One that does not reopen anyway (damage) never costs data: its
blobs stay where they are, loads of them are misses that touch no tier, saves under it fail, and the
daemon says so (the log at open, the durable tier's errors in ``stats``, health ``kvstore.layouts``);
registering the definition again rewrites it and its data is served again.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.format.layout import Layout, layout_by_id
from kvstore.format.page_layout import PageLayout, PageLayoutError
from kvstore.store.tiered.store import TieredStore
from kvstore.tiers.base import WriteBatch

log = logging.getLogger(__name__)
KEY_PREFIX = b"L:"
HOLDER_PREFIX = b"H:"
#: The holder of a global page layout (no namespace is empty: ``check_namespace``).
GLOBAL = ""
_ID = 16

AnyLayout = Layout | PageLayout


def _holder_key(layout_id: bytes, namespace: str) -> bytes:
    return HOLDER_PREFIX + layout_id + namespace.encode()


class Layouts:
    def __init__(self, store: TieredStore, max_per_namespace: int) -> None:
        self._store = store
        self.max_per_namespace = max_per_namespace
        self._lock = threading.Lock()
        self._pages: dict[bytes, PageLayout] = {}
        self._holders: dict[bytes, set[str]] = {}
        self._held: Counter[str] = Counter()
        #: Stored definitions that did not reopen, by id: why (their data is kept, see the module doc).
        self.unreadable: dict[bytes, str] = {}
        self._open()

    def _open(self) -> None:
        for key in list(self._store.meta_keys(HOLDER_PREFIX)):
            lid, ns = key[len(HOLDER_PREFIX):][:_ID], key[len(HOLDER_PREFIX) + _ID:]
            if len(lid) == _ID and ns.isascii():
                self._holders.setdefault(lid, set()).add(ns.decode())
        for key in list(self._store.meta_keys(KEY_PREFIX)):
            lid = key[len(KEY_PREFIX):]
            blob = self._store.get_meta(key)
            try:
                lay = PageLayout.from_definition(blob if blob is not None else b"")
                if lay.layout_id != lid:
                    raise PageLayoutError(f"its definition is that of layout {lay.layout_hex}")
            except PageLayoutError as e:
                self._unreadable(lid, str(e))
                continue
            self._pages[lid] = lay
            self._holders.setdefault(lid, {GLOBAL})  # stored before holders were kept: global, as then
        for lid, holders in self._holders.items():
            self._held.update(holders)
            if lid not in self._pages and lid not in self.unreadable:
                self._unreadable(lid, "its definition is missing")

    def _unreadable(self, layout_id: bytes, why: str) -> None:
        self.unreadable[layout_id] = why
        what = (f"page layout {layout_id.hex()} did not reopen ({why}): its data is kept; loads of its blobs "
                f"miss and saves under it fail until its definition is registered again")
        log.error("%s", what)
        self._store.report_damage(what)

    # -- what a namespace may use ---------------------------------------------------------------
    def get(self, layout_id: bytes) -> AnyLayout | None:
        """The layout of stored data, whoever holds it (reads and stats): a preset or a page layout."""
        return layout_by_id(layout_id) or self._pages.get(layout_id)

    def page(self, layout_id: bytes) -> PageLayout | None:
        """The page layout of stored data, whoever holds it; None for a token layout or an unknown id."""
        return self._pages.get(layout_id)

    def usable(self, namespace: str, layout_id: bytes) -> PageLayout | None:
        """The page layout ``namespace`` may save under: one it holds, or a global one."""
        lay = self._pages.get(layout_id)
        holders = self._holders.get(layout_id, ())
        return lay if lay is not None and (namespace in holders or GLOBAL in holders) else None

    def known(self, namespace: str, layout_id: bytes) -> AnyLayout:
        """A preset or a page layout ``namespace`` may use; InvalidArgument (the same for every id it may
        not use, registered by another namespace or by none) otherwise."""
        lay = layout_by_id(layout_id) or self.usable(namespace, layout_id)
        if lay is None:
            raise InvalidArgument(f"unknown layout id {bytes(layout_id).hex()}; see `kvstore layout list`, or "
                                  f"register an engine page layout first (RegisterLayout)")
        return lay

    # -- registering ----------------------------------------------------------------------------
    def register(self, definition: bytes, namespaces: Sequence[str]) -> PageLayout:
        """Accept an engine page layout for ``namespaces`` (``GLOBAL``: every namespace). Idempotent:
        the same definition gives the same id; see the module doc for the quota."""
        try:
            lay = PageLayout.from_definition(definition)
            canonical = lay.definition()
            if PageLayout.from_definition(canonical) != lay:  # what a restart reads must be this layout
                raise PageLayoutError("its canonical form does not read back as the same layout")
        except PageLayoutError as e:
            raise InvalidArgument(str(e)) from None
        lid = lay.layout_id
        if not namespaces:
            raise InvalidArgument("a page layout is registered for a namespace; this token covers none")
        with self._lock:
            holders = self._holders.get(lid, set())
            new = [ns for ns in dict.fromkeys(namespaces) if ns not in holders and GLOBAL not in holders]
            if not new and lid in self._pages:
                return self._pages[lid]
            for ns in new:
                if self._held[ns] >= self.max_per_namespace:
                    who = "global page layouts" if ns == GLOBAL else f"namespace {ns!r}"
                    raise ResourceExhausted(f"{who} hold {self._held[ns]} page layouts, the most allowed "
                                            f"([store] max_layouts_per_namespace)")
            self._store.commit(WriteBatch(meta_puts=[(KEY_PREFIX + lid, canonical),
                                                     *((_holder_key(lid, ns), b"") for ns in new)]))
            self._pages[lid] = lay
            self._holders.setdefault(lid, set()).update(new)
            self._held.update(new)
            if self.unreadable.pop(lid, None) is not None:
                log.info("page layout %s registered again: its data is served again", lay.layout_hex)
        log.info("registered page layout %s (%s, %s) for %s", lay.layout_hex, lay.engine, lay.name,
                 ", ".join(ns or "every namespace" for ns in new) or "its holders")
        return lay
