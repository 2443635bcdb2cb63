"""A turn save waiting for its group commit (``group_commit.py``): validated, not yet written. A turn
names its session's new version whole (a manifest) or by what it adds to the version it extends (an
``Append``: O(the turn), on the wire and on disk)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.format.manifest import Manifest
from kvstore.format.turn_record import Append
from kvstore.results import SaveResult
from kvstore.store.sessions.kind import Positions, SessionKind

#: What a committed turn gives its caller: the manifest as committed, and its chunks' keys.
SavedTurn = tuple[Manifest, SaveResult]
__all__ = ["Append", "SavedTurn", "Turn"]


@dataclass(frozen=True)
class Turn:
    """A validated turn waiting for its group commit."""

    namespace: str
    layout_id: bytes
    parent: bytes
    first_index: int
    keys: list[bytes]
    blobs: Sequence[bytes | memoryview]
    #: The new version whole (a save of a manifest), or None for an append (built at commit, from the base).
    manifest: Manifest | None
    #: The session's kind, chosen from its layout when the turn was validated.
    kind: SessionKind
    #: Where in the manifest the chunks this turn brings sit (``SessionKind.positions``); of an append, in
    #: the keys it adds (``SessionKind.positions`` of them, from ``first_index`` less the base's chunk count).
    positions: Positions
    append: Append | None = None

    @property
    def session_id(self) -> str:
        return self.manifest.session_id if self.manifest is not None else self.append.session_id  # type: ignore[union-attr]
