"""Sessions of engine pages (``store/sessions/kind.py``): an engine's KV blocks (``format/page.py``) of a page
layout a namespace registered (``layouts.py``), keyed by the engine's block hashes. The manifest names
their keys, every group's, in any order, with ``chunk_tokens`` 0, no trailing span and no token ids
(the engine keeps those and replays the last 128 tokens itself). A block needs no place in a chain:
its key is the engine's chained block hash, so equal keys already mean equal prefixes.

Below the kind, its checks of page blobs, pure functions: a save's keys (``page.check``) and a load's
batch check (the C kernel, ``_chunks.check_pages``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.format import page
from kvstore.format.chunk_batch import _chunks
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Kind, Manifest
from kvstore.format.page_layout import PageLayout
from kvstore.store.sessions.chunk_index import ChunkIndex, ChunkInfo
from kvstore.store.sessions.kind import UNREADABLE, Positions, StoredSizes, verify_threads
from kvstore.store.sessions.layouts import Layouts
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
                   blobs: Sequence[bytes | memoryview], sealed: int = 0) -> list[bytes]:
        return page_batch_keys(namespace, self._usable(namespace, layout_id), blobs, sealed)

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

    def positions_added(self, m: Manifest, start: int, first_index: int, parent: bytes,
                        keys: Sequence[bytes]) -> Positions:
        mine = set(keys)
        at = frozenset(i for i in range(start, len(m.chunk_keys)) if m.chunk_keys[i] in mine)
        if len({m.chunk_keys[i] for i in at}) != len(mine):
            raise InvalidArgument("the append does not name every saved page blob among the keys it adds")
        return at

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


def page_batch_keys(namespace: str, lay: PageLayout, blobs: Sequence[bytes | memoryview], sealed: int = 0
                    ) -> list[bytes]:
    """The keys of a batch of page blobs; InvalidArgument unless every blob is a sound block of
    ``lay`` stored under the key its namespace, group and block hash give. The first ``sealed`` were
    sealed by this daemon over its own private copy (``SessionKind.batch_keys``): every check but a
    second pass of their checksum."""
    keys: list[bytes] = []
    for n, blob in enumerate(blobs):
        try:
            keys.append(page.check(blob, lay, namespace, verify=n >= sealed).key)
        except page.PageError as e:
            raise InvalidArgument(f"page blob {n}: {e}") from e
    return keys


def page_matches(key: bytes, namespace: str, lay: PageLayout, blob: Stored) -> bool:
    """Whether ``blob`` is the block ``key`` names for ``namespace``: structure, key and checksum."""
    try:
        return page.check(blob, lay, namespace).key == key
    except page.PageError:
        return False


def pages_match(keys: Sequence[bytes], namespace: str, lay: PageLayout, blobs: Sequence[Stored | None],
                threads: int = 1) -> list[bool]:
    """``page_matches`` for a batch of blobs of one layout and namespace (None: a miss): one call of
    the C kernel (``_chunks.check_pages``: every check of ``page.check`` and the key asked for, the
    GIL released, the batch over ``threads`` threads) where it was built; else blob by blob."""
    if _chunks is None or not hasattr(_chunks, "check_pages"):
        def one(key: bytes, blob: Stored | None) -> Callable[[], bool]:
            return lambda: blob is not None and page_matches(key, namespace, lay, blob)
        return all_match([one(k, b) for k, b in zip(keys, blobs)], threads)
    groups = list(lay.groups)
    status = np.ones(len(keys), np.uint8)
    if any(len(k) != 16 for k in keys):  # not a page key: never a match
        return [False] * len(keys)
    _chunks.check_pages(list(blobs), b"".join(keys), lay.layout_id, namespace.encode(),
                        np.array([g.group for g in groups], np.int64),
                        np.array([g.block_bytes for g in groups], np.int64),
                        np.array([page.codes_end(g) for g in groups], np.int64), status, threads)
    return (status == 0).tolist()


def all_match(checks: Sequence[Callable[[], bool]], threads: int = 1) -> list[bool]:
    """Each check's answer, the list cut into ``threads`` runs checked side by side (a page blob's
    checksum, xxhash, releases the GIL: a long load's checks take the cores, as the chunks' do)."""
    out = [False] * len(checks)
    threads = max(1, min(threads, len(checks)))

    def run(part: range) -> None:
        for i in part:
            out[i] = checks[i]()

    bounds = [len(checks) * t // threads for t in range(threads + 1)]
    helpers = [threading.Thread(target=run, args=(range(bounds[t], bounds[t + 1]),)) for t in range(1, threads)]
    for h in helpers:
        h.start()
    try:
        run(range(bounds[0], bounds[1]))
    finally:
        for h in helpers:
            h.join()
    return out
