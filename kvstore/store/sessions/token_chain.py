"""Sessions of token chains (``store/sessions/kind.py``): chunks of C tokens of a preset layout, each keyed by
its token ids chained to the chunk before (``format/keys.py``), a trailing span of fewer than C
tokens and the ids of the last 128 in the manifest. A chunk has one place: chunk i holds tokens
[i C, (i+1) C) and follows chunk i-1, and a load checks that place again (``chunk_batch.check``).

Below the kind, what a save of a chain must satisfy before anything is written, pure checks: chunks
that are what their keys say, manifests consistent with their layout and their trailing span."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.format import chunk, chunk_batch
from kvstore.format.chunk_batch import Expected
from kvstore.format.keys import ROOT, chain_keys, chunk_key_raw
from kvstore.format.layout import Layout, layout_by_id
from kvstore.format.manifest import LAST_TOKEN_IDS, Kind, Manifest
from kvstore.store.sessions.chunk_index import ChunkIndex, ChunkInfo
from kvstore.store.sessions.index import common_prefix
from kvstore.store.sessions.kind import UNREADABLE, Positions, StoredSizes, verify_threads
from kvstore.tiers.base import Stored


class TokenChain:
    kind = Kind.TOKEN_CHAIN

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens

    def batch_keys(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                   blobs: Sequence[bytes | memoryview], sealed: int = 0) -> list[bytes]:
        if sealed:
            raise InvalidArgument("token chunks are sealed by their client, never by the daemon")
        lay = chunk_layout(layout_id, self.chunk_tokens)
        return chunk_batch_keys(namespace, lay, self.chunk_tokens, parent, first_index, blobs)

    def prefix_keys(self, namespace: str, layout_id: bytes, token_ids: Sequence[int]) -> list[bytes]:
        return chain_keys(layout_id, namespace, token_ids, self.chunk_tokens)

    def check_manifest(self, m: Manifest) -> None:
        manifest_layout(m, self.chunk_tokens)  # C is the store's: a manifest of engine pages says 0

    def positions(self, m: Manifest, first_index: int, keys: Sequence[bytes]) -> Positions:
        end = first_index + len(keys)
        if list(m.chunk_keys[first_index:end]) != list(keys):
            raise InvalidArgument(f"the manifest does not name the saved chunks as its chunks {first_index} to "
                                  f"{end - 1}")
        return range(first_index, end)

    def positions_added(self, m: Manifest, start: int, first_index: int, parent: bytes,
                        keys: Sequence[bytes]) -> Positions:
        if not keys:
            return range(0)
        if first_index < start:
            raise InvalidArgument(f"an append's chunks follow the session's {start}: its first is chunk {first_index}")
        want = m.chunk_keys[first_index - 1] if first_index else ROOT
        if first_index > len(m.chunk_keys) or parent != want:
            raise InvalidArgument(f"the saved chunks follow {parent.hex()}; the append's chunk {first_index - 1} is "
                                  f"{want.hex() if first_index <= len(m.chunk_keys) else 'not there'}")
        return self.positions(m, first_index, keys)

    def record(self, index: ChunkIndex, namespace: str, layout_id: bytes, keys: Sequence[bytes],
               first_index: int = 0, parent: bytes = ROOT) -> None:
        for n, key in enumerate(keys):
            index.add(key, ChunkInfo(namespace, layout_id, parent, first_index + n, self.kind))
            parent = key

    def check_place(self, m: Manifest, i: int, info: ChunkInfo) -> None:
        parent = m.chunk_keys[i - 1] if i else ROOT
        if info.index != i or info.parent != parent:
            raise InvalidArgument(f"chunk {i} ({m.chunk_keys[i].hex()}) is out of place: it is chunk {info.index} of "
                                  f"its sequence and follows {info.parent.hex()}, not {parent.hex()}")

    def unchanged(self, old: Sequence[bytes], new: Sequence[bytes]) -> int:
        return common_prefix(old, new)

    def verify(self, keys: Sequence[bytes], infos: Sequence[ChunkInfo], values: Sequence[Stored]) -> list[bool]:
        """One ``chunk_batch.check``: checksum, header, place, and the key from the chunk's own token ids."""
        if not keys:
            return []
        expected = Expected(keys, [i.layout_id for i in infos], [i.index * self.chunk_tokens for i in infos],
                            self.chunk_tokens, infos[0].namespace, [i.parent for i in infos])
        return chunk_batch.check(values, expected, threads=verify_threads(values)).valid.tolist()  # type: ignore[no-any-return]

    def sizes(self, layout_id: bytes) -> StoredSizes:
        lay = layout_by_id(layout_id)
        if lay is None:
            return UNREADABLE
        return StoredSizes(Fraction(self.chunk_tokens), Fraction(lay.chunk_payload_bytes(self.chunk_tokens)),
                           chunk.encoded_size(lay, self.chunk_tokens))

    def tail_payload(self, m: Manifest) -> int:
        lay = layout_by_id(m.layout_id)
        return lay.chunk_payload_bytes(m.tail_tokens) if lay is not None else 0


U32 = 1 << 32


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
    check_manifest_tokens(m, lay)
    return lay


def check_manifest_tokens(m: Manifest, lay: Layout) -> None:
    """The token ids a manifest of token chunks carries: ``last_token_ids`` holds exactly the ids of
    its last min(token_count, 128) tokens (what bounded replay feeds the model), each a u32, and
    agrees with the trailing span's own ids where the two overlap (the span's last min(t, 128)). Ids
    that fall in complete chunks are checked by a reader against the chunks' key chain (a resume
    does). ``m.tail`` must already have passed ``chunk.check`` (``manifest_layout``)."""
    want = min(m.token_count, LAST_TOKEN_IDS)
    ids = m.last_token_ids
    if len(ids) != want:
        raise InvalidArgument(f"last_token_ids holds {len(ids)} ids; a session of {m.token_count} tokens needs the "
                              f"ids of its last {want}")
    bad = next((i for i, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < U32),
               None)
    if bad is not None:
        raise InvalidArgument(f"last_token_ids[{bad}] is {ids[bad]!r}, not a token id (an int in [0, 2^32))")
    h = chunk.check(m.tail, lay, verify=False)  # parsed and verified before: its header only
    n = min(h.token_count, want)  # the last n ids are in both
    if not n:
        return
    span = np.frombuffer(m.tail, "<u4", n, h.tokens_offset + 4 * (h.token_count - n))
    differ = np.flatnonzero(np.asarray(ids[-n:], dtype=np.int64) != span)
    if differ.size:
        j = int(differ[0])
        raise InvalidArgument(f"last_token_ids disagree with the trailing span's token ids: token "
                              f"{m.token_count - n + j} is {ids[want - n + j]} in last_token_ids, {int(span[j])} in "
                              f"the span")
