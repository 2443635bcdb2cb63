"""Sessions of engine pages (``session_kind.py``): an engine's KV blocks (``format/page.py``) of a page
layout a namespace registered (``layouts.py``), keyed by the engine's block hashes. The manifest names
their keys, every group's, in any order, with ``chunk_tokens`` 0, no trailing span and no token ids
(the engine keeps those and replays the last 128 tokens itself). A block needs no place in a chain:
its key is the engine's chained block hash, so equal keys already mean equal prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from kvstore.errors import InvalidArgument
from kvstore.format import page
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Kind, Manifest
from kvstore.format.page_layout import PageLayout
from kvstore.store.chunk_index import ChunkIndex, ChunkInfo
from kvstore.store.layouts import Layouts
from kvstore.store.pages import page_batch_keys, pages_match
from kvstore.store.session_kind import UNREADABLE, Positions, StoredSizes, verify_threads
from kvstore.tiers.base import Stored

#: The block hash length a page blob is counted with in the stats (vLLM's sha256 block hashes): the
#: store does not keep each blob's length, and the header is a small part of a blob either way.
STATS_BLOCK_HASH_BYTES = 32


class EnginePages:
    kind = Kind.ENGINE_PAGES

    def __init__(self, layouts: Layouts) -> None:
        self.layouts = layouts

    def _usable(self, namespace: str, layout_id: bytes) -> PageLayout:
        lay = self.layouts.usable(namespace, layout_id)
        assert lay is not None, "the kind was chosen from this layout (Kinds.for_layout)"
        return lay

    def batch_keys(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                   blobs: Sequence[bytes | memoryview]) -> list[bytes]:
        return page_batch_keys(namespace, self._usable(namespace, layout_id), blobs)

    def prefix_keys(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> list[bytes]:
        raise InvalidArgument("engine page blobs are looked up by key (LookupKeys), not by token ids")

    def check_manifest(self, m: Manifest) -> None:
        if m.kind is not self.kind:
            raise InvalidArgument("a session of engine pages has chunk_tokens 0, no trailing span and no token ids "
                                  "(the engine replays its own tokens)")

    def positions(self, m: Manifest, first_index: int, keys: Sequence[bytes]) -> Positions:
        mine = set(keys)
        if not mine <= set(m.chunk_keys):
            raise InvalidArgument("the manifest does not name every saved page blob")
        return frozenset(i for i, k in enumerate(m.chunk_keys) if k in mine)

    def record(self, index: ChunkIndex, namespace: str, layout_id: bytes, keys: Sequence[bytes],
               first_index: int = 0, parent: bytes = ROOT) -> None:
        for key in keys:
            index.add(key, ChunkInfo(namespace, layout_id, ROOT, -1, self.kind))

    def check_place(self, m: Manifest, i: int, info: ChunkInfo) -> None:
        return  # in no chain: any place

    def unchanged(self, old: Sequence[bytes], new: Sequence[bytes]) -> int:
        return 0  # in no order: a turn checks every block it names

    def verify(self, keys: Sequence[bytes], infos: Sequence[ChunkInfo], values: Sequence[Stored]) -> list[bool]:
        """One ``pages_match`` (the C kernel) per layout and namespace (a load's are one of each)."""
        threads = verify_threads(values)
        runs: dict[tuple[bytes, str], list[int]] = {}
        for i, info in enumerate(infos):
            runs.setdefault((info.layout_id, info.namespace), []).append(i)
        ok = [False] * len(keys)
        for (layout_id, namespace), idx in runs.items():
            lay = self.layouts.page(layout_id)
            assert lay is not None, "a blob of a layout this store does not know is never read (SessionReads._readable)"
            good = pages_match([keys[i] for i in idx], namespace, lay, [values[i] for i in idx], threads)
            for i, g in zip(idx, good):
                ok[i] = g
        return ok

    def sizes(self, layout_id: bytes) -> StoredSizes:
        """A page blob is one group's block: its share of the block's tokens is tokens / groups, exactly
        so when every block of a session has every group (as in vLLM)."""
        lay = self.layouts.page(layout_id)
        if lay is None:
            return UNREADABLE
        n = len(lay.groups)
        tokens = Fraction(sum(g.tokens for g in lay.groups), n * n)
        encoded = sum(page.blob_bytes(g, STATS_BLOCK_HASH_BYTES) for g in lay.groups) // n
        return StoredSizes(tokens, tokens * lay.bytes_per_token, encoded)

    def tail_payload(self, m: Manifest) -> int:
        return 0  # no trailing span
