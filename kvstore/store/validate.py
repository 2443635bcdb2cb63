"""What a save must satisfy before anything is written: chunks that are what their keys say, and
manifests consistent with their layout and their trailing span. Pure checks, no store state."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore import chunk
from kvstore.errors import InvalidArgument
from kvstore.keys import ROOT, chunk_key_raw
from kvstore.layout import Layout, layout_by_id
from kvstore.manifest import Manifest


def known_layout(layout_id: bytes) -> Layout:
    lay = layout_by_id(layout_id)
    if lay is None:
        raise InvalidArgument(f"unknown layout id {layout_id.hex()}; see `kvstore layout list`")
    return lay


def chunk_layout(layout_id: bytes, chunk_tokens: int) -> Layout:
    """The layout of a save, if chunks of ``chunk_tokens`` tokens split it into whole entries."""
    lay = known_layout(layout_id)
    if chunk_tokens % lay.granularity:
        raise InvalidArgument(f"chunk size {chunk_tokens} is not a multiple of layout {lay.name}'s m")
    return lay


def chunk_batch_keys(namespace: str, lay: Layout, chunk_tokens: int, parent: bytes, first_index: int,
                     blobs: Sequence[bytes | memoryview]) -> list[bytes]:
    """The keys of consecutive complete chunks of one sequence, starting at chunk ``first_index``
    whose parent key is ``parent``; InvalidArgument unless every blob is exactly that chunk.

    Per blob: one header parse, one checksum pass, the section table's bounds, and one xxh3 pass
    over its token ids for the key. No section is turned into an array (``chunk.check``)."""
    if first_index < 0 or (first_index == 0) != (parent == ROOT):
        raise InvalidArgument("the first chunk (index 0) and only it has the all-zero parent key")
    keys: list[bytes] = []
    for n, blob in enumerate(blobs):
        idx = first_index + n
        try:
            h = chunk.check(blob, lay)
        except chunk.ChunkError as e:
            raise InvalidArgument(f"chunk {idx}: {e}") from e
        if h.token_count != chunk_tokens or h.start != idx * chunk_tokens:
            raise InvalidArgument(f"chunk {idx}: holds tokens [{h.start}, {h.start + h.token_count}), expected "
                                  f"[{idx * chunk_tokens}, {(idx + 1) * chunk_tokens}) (chunk size {chunk_tokens})")
        want = chunk_key_raw(lay.layout_id, namespace, parent, chunk.token_ids_raw(blob, h))
        if h.key != want:
            raise InvalidArgument(f"chunk {idx}: key {h.key.hex()} does not match its tokens, namespace "
                                  f"and parent (expected {want.hex()})")
        keys.append(want)
        parent = want
    return keys


def manifest_layout(m: Manifest, chunk_tokens: int) -> Layout:
    """Check a manifest against the store's chunk size and its own trailing span; its layout."""
    lay = known_layout(m.layout_id)
    if m.chunk_tokens != chunk_tokens:
        raise InvalidArgument(f"manifest uses {m.chunk_tokens}-token chunks; this store uses {chunk_tokens}")
    try:
        tail = chunk.check(m.tail, lay)
    except chunk.ChunkError as e:
        raise InvalidArgument(f"trailing span: {e}") from e
    if tail.token_count != m.tail_tokens or tail.start != len(m.chunk_keys) * m.chunk_tokens:
        raise InvalidArgument(f"trailing span holds tokens [{tail.start}, {tail.start + tail.token_count}); "
                              f"the manifest needs {m.tail_tokens} from {len(m.chunk_keys) * m.chunk_tokens}")
    return lay
