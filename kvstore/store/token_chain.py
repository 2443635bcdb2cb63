"""Sessions of token chains (``session_kind.py``): chunks of C tokens of a preset layout, each keyed by
its token ids chained to the chunk before (``format/keys.py``), a trailing span of fewer than C
tokens and the ids of the last 128 in the manifest. A chunk has one place: chunk i holds tokens
[i C, (i+1) C) and follows chunk i-1, and a load checks that place again (``chunk_batch.check``)."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from kvstore.errors import InvalidArgument
from kvstore.format import chunk, chunk_batch
from kvstore.format.chunk_batch import Expected
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.layout import layout_by_id
from kvstore.format.manifest import Kind, Manifest
from kvstore.store.chunk_index import ChunkIndex, ChunkInfo
from kvstore.store.session_index import common_prefix
from kvstore.store.session_kind import UNREADABLE, Positions, StoredSizes, verify_threads
from kvstore.store.validate import chunk_batch_keys, chunk_layout, manifest_layout
from kvstore.tiers.base import Stored


class TokenChain:
    kind = Kind.TOKEN_CHAIN

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens

    def batch_keys(self, namespace: str, layout_id: bytes, parent: bytes, first_index: int,
                   blobs: Sequence[bytes | memoryview]) -> list[bytes]:
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
