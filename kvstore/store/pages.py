"""What a store checks of engine page blobs (``kvstore/format/page.py``), beside the chunk checks of
``validate.py`` and ``chunk_index.py``: pure functions, no store state. Sessions of engine pages
use them through their kind (``engine_pages.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.format import chunk, page
from kvstore.format.chunk_batch import _chunks
from kvstore.format.page_layout import PageLayout
from kvstore.tiers.base import Stored


def page_batch_keys(namespace: str, lay: PageLayout, blobs: Sequence[bytes | memoryview]) -> list[bytes]:
    """The keys of a batch of page blobs; InvalidArgument unless every blob is a sound block of
    ``lay`` stored under the key its namespace, group and block hash give."""
    keys: list[bytes] = []
    for n, blob in enumerate(blobs):
        try:
            keys.append(page.check(blob, lay, namespace).key)
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


def is_valid_blob(key: bytes, blob: Stored) -> bool:
    """A stored value (chunk or page blob) is served only if its checksum holds and it claims ``key``."""
    try:
        if page.is_page(blob):
            h = page.read_header(blob)
            page.verify_checksum(blob)
            return h.key == key
        header = chunk.read_header(blob)
        chunk.verify_checksum(blob)
    except (chunk.ChunkError, page.PageError):
        return False
    return header.key == key


def compressible_offset(blob: Stored) -> int:
    """Where a stored value's compressible tail starts (chunk or page blob); 0 for anything else."""
    return page.compressible_offset(blob) if page.is_page(blob) else chunk.compressible_offset(blob)
