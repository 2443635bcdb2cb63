"""Which layouts a store accepts: kvstore's token layouts (the presets) and the engine page
layouts that clients registered (``RegisterLayout``), kept durably in the meta keyspace so a
restarted daemon still checks, serves and counts the blocks stored under them."""

from __future__ import annotations

import logging
import threading

from kvstore.errors import InvalidArgument
from kvstore.format.layout import Layout, layout_by_id
from kvstore.format.page_layout import PageLayout, PageLayoutError
from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)
KEY_PREFIX = b"L:"
#: How many engine page layouts one store keeps (each engine configuration registers one).
MAX_PAGE_LAYOUTS = 1024

AnyLayout = Layout | PageLayout


class Layouts:
    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._pages: dict[bytes, PageLayout] = {}
        for key in list(store.meta_keys(KEY_PREFIX)):
            blob = store.get_meta(key)
            try:
                lay = PageLayout.from_definition(blob) if blob is not None else None
            except PageLayoutError as e:
                log.error("page layout %r is damaged (%s): ignored", key, e)
                continue
            if lay is not None and KEY_PREFIX + lay.layout_id == key:
                self._pages[lay.layout_id] = lay

    def page(self, layout_id: bytes) -> PageLayout | None:
        return self._pages.get(layout_id)

    def get(self, layout_id: bytes) -> AnyLayout | None:
        return layout_by_id(layout_id) or self._pages.get(layout_id)

    def known(self, layout_id: bytes) -> AnyLayout:
        lay = self.get(layout_id)
        if lay is None:
            raise InvalidArgument(f"unknown layout id {bytes(layout_id).hex()}; see `kvstore layout list`, or "
                                  f"register an engine page layout first (RegisterLayout)")
        return lay

    def register(self, definition: bytes) -> PageLayout:
        """Accept an engine page layout (idempotent: the same definition gives the same id)."""
        try:
            lay = PageLayout.from_definition(definition)
        except PageLayoutError as e:
            raise InvalidArgument(str(e)) from None
        with self._lock:
            if lay.layout_id in self._pages:
                return self._pages[lay.layout_id]
            if len(self._pages) >= MAX_PAGE_LAYOUTS:
                raise InvalidArgument(f"this store already holds {MAX_PAGE_LAYOUTS} page layouts")
            self._store.put_meta(KEY_PREFIX + lay.layout_id, lay.definition())
            self._pages[lay.layout_id] = lay
        log.info("registered page layout %s (%s, %s)", lay.layout_hex, lay.engine, lay.name)
        return lay
