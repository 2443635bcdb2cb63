"""Which namespace owns each stored chunk, and where the chunk sits in its sequence.

A chunk's key hashes its layout, namespace, parent key and token ids, so the save that validated
it (or the manifest that names it) tells exactly who owns it and where it belongs. The index is
filled at save and rebuilt at open from the manifests. It serves three rules:

- ownership: a request sees only chunks its namespace owns; another namespace's chunk answers
  exactly as an absent one (same result, same counters, no tier touched);
- a hit is verified against it (``store/sessions/reads.py``, by ``kvstore.format.chunk_batch.check``): the
  stored chunk's own token ids, hashed with the owner, parent and layout recorded here, must give
  the key it was found under (a collision, or a chunk planted under another's key, is a miss,
  never served);
- a manifest is consistent with it: chunk i holds tokens [i*C, (i+1)*C), follows chunk i-1, and
  is of the manifest's layout.

Entries are made by their session's kind (``store/sessions/kind.py``): a token chain's chunks with their
place, an engine's page blobs in none (their keys are chained by the engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvstore.format.manifest import Kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkInfo:
    """What the store knows of one chunk: its owner and its place (all hashed into its key)."""

    namespace: str
    layout_id: bytes
    parent: bytes  # the previous chunk's key; ROOT for a sequence's first chunk
    index: int  # position in its sequence: the chunk holds tokens [index * C, (index + 1) * C)
    #: The kind of the sessions it belongs to (``store/sessions/kind.py``): what verifies it. An engine
    #: page blob has no place in a chain (its key is the engine's chained block hash): index -1, parent ROOT.
    kind: Kind = Kind.TOKEN_CHAIN


class ChunkIndex:
    """key -> ChunkInfo. Not locked: the session store's lock guards it."""

    def __init__(self) -> None:
        self._info: dict[bytes, ChunkInfo] = {}

    def __len__(self) -> int:
        return len(self._info)

    def add(self, key: bytes, info: ChunkInfo) -> None:
        old = self._info.setdefault(key, info)
        if old != info:  # only an inconsistent manifest of an older version can disagree
            log.error("chunk %s is recorded as %s; ignoring a conflicting %s", key.hex(), old, info)

    def owned(self, namespace: str, key: bytes) -> ChunkInfo | None:
        """The chunk's info if ``namespace`` owns it; None if it is absent or someone else's (one
        answer for both, by design)."""
        info = self._info.get(key)
        return info if info is not None and info.namespace == namespace else None

    def discard(self, key: bytes) -> None:
        self._info.pop(key, None)
