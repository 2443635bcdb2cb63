"""What kind a session is, chosen once from its layout: a token chain (``token_chain.py``) or engine
pages (``engine_pages.py``), each one object that answers every question the store has of that kind.

The kind is chosen when a session is saved, from the layout its namespace may use (a preset of
``kvstore.format.layout``: a token chain; a registered ``PageLayout``: engine pages), checked
against what the manifest says (``Manifest.kind``, stored with it) and recorded with each blob the
index knows (``ChunkInfo.kind``). From then on the store asks the kind, never the shape of a record:
how a save's blobs are keyed and checked, what its manifest must satisfy, where its blobs sit, how a
batch of stored copies is verified on a load, and what the stats count of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from kvstore.format.keys import ROOT
from kvstore.format.manifest import Kind, Manifest
from kvstore.format.page_layout import PageLayout
from kvstore.store.sessions.chunk_index import ChunkIndex, ChunkInfo
from kvstore.store.sessions.layouts import AnyLayout, Layouts
from kvstore.tiers.base import Stored

#: A batch this large is verified by up to VERIFY_THREADS threads (the kernels release the GIL: a
#: resume waits on its checks).
VERIFY_SPLIT_BYTES = 16 << 20
VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Where a save's blobs sit in its manifest: consecutive chunks of a chain, or wherever it names pages.
Positions = range | frozenset[int]


def verify_threads(values: Sequence[Stored]) -> int:
    """How many threads verify a batch of stored copies: one, or VERIFY_THREADS for a long load's."""
    return VERIFY_THREADS if sum(len(v) for v in values) >= VERIFY_SPLIT_BYTES else 1


@dataclass(frozen=True)
class StoredSizes:
    """What one stored blob of a layout stands for in the stats: its share of the session's tokens,
    the payload bytes the layout's formula gives them, and its encoded size."""

    tokens: Fraction
    payload: Fraction
    encoded: int


#: A blob whose layout this store cannot read stands for nothing we can say.
UNREADABLE = StoredSizes(Fraction(0), Fraction(0), 0)


class SessionKind(Protocol):
    """One kind of session. Methods given a layout id are only given one of this kind."""

    #: What a manifest of this kind says (``Manifest.kind``).
    kind: Kind

    def batch_keys(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                   blobs: Sequence[bytes | memoryview], sealed: int = 0) -> list[bytes]:
        """The keys of a save's blobs; InvalidArgument unless each is exactly what its key names
        (``parent`` and ``first_index``: where a chain's first one goes; pages have no place).
        ``sealed``: the first ``sealed`` blobs were built and sealed by this daemon (engine pages it
        read from the caller's memory, ``transport/slots.py``): their checksum is its own, computed
        over its private copy, and is not computed again (their header and key still are checked)."""
        ...

    def prefix_keys(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The keys of the stored blobs of ``token_ids``'s prefixes, in order (a prefix lookup);
        InvalidArgument where keys are not made from token ids."""
        ...

    def check_manifest(self, m: Manifest) -> None:
        """InvalidArgument unless ``m`` is a manifest of this kind the store may commit."""
        ...

    def positions(self, m: Manifest, first_index: int, keys: Sequence[bytes]) -> Positions:
        """Where a save's blobs (``keys``, brought from ``first_index``) sit in ``m``; InvalidArgument
        unless ``m`` names them there."""
        ...

    def positions_added(self, m: Manifest, start: int, first_index: int, parent: bytes,
                        keys: Sequence[bytes]) -> Positions:
        """``positions`` for an append: where a save's blobs (``keys``, brought from ``first_index``
        after ``parent``) sit among the keys ``m`` adds from chunk ``start``; InvalidArgument unless
        there. O(the keys added)."""
        ...

    def record(self, index: ChunkIndex, namespace: str, layout_id: bytes, keys: Sequence[bytes],
               first_index: int = 0, parent: bytes = ROOT) -> None:
        """Enter blobs of a validated save or of a manifest into the index, each with its place."""
        ...

    def check_place(self, m: Manifest, i: int, info: ChunkInfo) -> None:
        """InvalidArgument unless the blob the index knows as ``info`` may be ``m``'s ``i``-th."""
        ...

    def unchanged(self, old: Sequence[bytes], new: Sequence[bytes]) -> int:
        """How many leading keys a session's new version has in the places its old version had them
        (those a turn need not check or index again)."""
        ...

    def verify(self, keys: Sequence[bytes], infos: Sequence[ChunkInfo], values: Sequence[Stored]) -> list[bool]:
        """Whether each stored copy is the blob its key names, as the index knows it: one batch, in
        the C kernel where it was built, a long load's over VERIFY_THREADS threads."""
        ...

    def sizes(self, layout_id: bytes) -> StoredSizes:
        """What one stored blob of ``layout_id`` counts for in the stats."""
        ...

    def tail_payload(self, m: Manifest) -> int:
        """The payload bytes of ``m``'s trailing span (counted in the stats with the chunks')."""
        ...


class Kinds:
    """The store's session kinds, one object each, and the choice of one from a layout."""

    def __init__(self, layouts: Layouts, token_chain: SessionKind, engine_pages: SessionKind) -> None:
        self._layouts = layouts
        self._kinds = {k.kind: k for k in (token_chain, engine_pages)}

    def of(self, kind: Kind) -> SessionKind:
        """The object of the kind a manifest or an index entry says."""
        return self._kinds[kind]

    def for_layout(self, namespace: str, layout_id: bytes) -> SessionKind:
        """The kind of a session ``namespace`` saves or looks up under ``layout_id``; InvalidArgument
        (one answer for every id it may not use) as ``Layouts.known``."""
        return self._of_layout(self._layouts.known(namespace, layout_id))

    def stored(self, layout_id: bytes) -> SessionKind | None:
        """The kind of stored data of ``layout_id``, whoever holds it; None where the layout is unknown
        here (a page layout that did not reopen, or one this daemon was never told of)."""
        lay = self._layouts.get(layout_id)
        return None if lay is None else self._of_layout(lay)

    def _of_layout(self, lay: AnyLayout) -> SessionKind:
        return self.of(Kind.ENGINE_PAGES if isinstance(lay, PageLayout) else Kind.TOKEN_CHAIN)
