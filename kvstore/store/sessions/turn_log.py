"""What the durable tier holds of a session's current version: its manifest (the base) and the turn
records appended since (``kvstore.format.turn_record``), and when the next save writes the manifest
whole instead (a compaction: the manifest rewritten and the turn records deleted, one transaction).

Compaction is due once the turns name as many keys as the base (and at least ``min_keys``): each
write of the whole manifest is paid for by as many keys appended as it holds, so a turn costs
O(what it adds) amortized, and reading a session at open reads O(its keys) whatever its history.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvstore.format.turn_record import turn_key
from kvstore.store.sessions.sharing import SessionRef


@dataclass(frozen=True)
class TurnLog:
    #: Turn records on disk: sequence numbers 0 .. records - 1 (some may be stale after damage).
    records: int = 0
    #: Chunk keys the manifest on disk names, and those its turn records add.
    base_keys: int = 0
    appended_keys: int = 0
    #: Whether the version on disk is the index's: False after damage (a record that does not chain) and
    #: for a version caught up from another daemon (only in memory here): the next save writes it whole.
    chains: bool = True
    #: Of a current version an append made: the generation it extended and that version's chunk count
    #: (its keys are chunks ``last_first``...); 0 and -1 otherwise. What tells the retry of an append whose
    #: answer was lost from a turn of another client (``TurnCommit.extend``).
    last_base: int = 0
    last_first: int = -1

    def due(self, added: int, min_keys: int) -> bool:
        """Whether a turn adding ``added`` keys writes the whole manifest instead of a turn record."""
        return not self.chains or self.appended_keys + added >= max(self.base_keys, min_keys)

    def appended(self, added: int, base: int, first: int) -> TurnLog:
        """After a turn record of ``added`` keys, appended to version ``base`` of ``first`` chunks."""
        return replace(self, records=self.records + 1, appended_keys=self.appended_keys + added, last_base=base,
                       last_first=first)

    def keys(self, ref: SessionRef) -> list[bytes]:
        """The keys of the session's turn records: what writing its manifest whole (or deleting it) deletes."""
        return [turn_key(*ref, seq) for seq in range(self.records)]


def whole(n: int, base: int = 0, first: int = -1) -> TurnLog:
    """A session whose manifest was just written whole, naming ``n`` keys (an append's, compacted: the
    version ``base`` it extended had ``first`` chunks)."""
    return TurnLog(0, n, 0, True, base, first)
