"""A turn save waiting for its group commit (``group_commit.py``): validated, not yet written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.format.manifest import Manifest
from kvstore.results import SaveResult

#: What a committed turn gives its caller: the manifest as committed, and its chunks' keys.
SavedTurn = tuple[Manifest, SaveResult]


@dataclass(frozen=True)
class Turn:
    """A validated turn waiting for its group commit."""

    namespace: str
    layout_id: bytes
    parent: bytes
    first_index: int
    keys: list[bytes]
    blobs: Sequence[bytes | memoryview]
    manifest: Manifest
    #: Engine page blobs: no chain, so their positions in the manifest are wherever it names them.
    pages: bool = False

    @property
    def batch(self) -> range | frozenset[int]:
        """The manifest positions of the chunks this turn brings."""
        if self.pages:
            mine = set(self.keys)
            return frozenset(i for i, k in enumerate(self.manifest.chunk_keys) if k in mine)
        return range(self.first_index, self.first_index + len(self.keys))
