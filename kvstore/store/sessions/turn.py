"""A turn save waiting for its group commit (``group_commit.py``): validated, not yet written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.format.manifest import Manifest
from kvstore.results import SaveResult
from kvstore.store.sessions.kind import Positions, SessionKind

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
    #: The session's kind, chosen from its layout when the turn was validated.
    kind: SessionKind
    #: Where in the manifest the chunks this turn brings sit (``SessionKind.positions``).
    positions: Positions
