"""Sharing sessions with other daemons: a layer the session store calls unconditionally, chosen once
from the config when the store is built (``kvstore.store.sharing_for``), as TinyDB composes a middleware.

``NoSharing`` (no Redis tier shares sessions) does nothing: its catch-ups find nothing, its
publishes publish nothing. ``SharedSessions`` (``shared_manifests.py``) publishes every save to a
Redis tier configured with ``share_sessions`` before it is acknowledged, and catches up with what
other daemons saved there before the store answers from its index.

The session store's side of the contract:
- before it answers from its index (``get``, ``list_sessions``, ``lookup``, a load of chunks it does
  not know), it indexes what ``catch_up_session`` / ``catch_up`` return (``SessionIndex.adopt``),
  keeping only versions ``advance`` accepts;
- it publishes a group of accepted turns (``publish_turns``, with the chunk count of the version
  each append extends: an append is published as what it adds) before committing them locally and
  commits only those that were published; ``forget`` undoes what was published when the local
  commit then fails; a delete or a touch is ``publish``-ed before it is applied locally; sessions
  whose TTL passed are told to ``expired`` once the index dropped them.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.format.manifest import Manifest

if TYPE_CHECKING:
    from kvstore.store.sessions.group_commit import Pending
    from kvstore.store.sessions.turn import SavedTurn, Turn
    from kvstore.store.tiered.store import TieredStore

SessionRef = tuple[str, str]  # (namespace, session id)
#: A version to index: the session, its generation, its manifest (None: deleted).
Update = tuple[SessionRef, int, Manifest | None]
#: A turn the commit accepted: its pending call, its manifest as committed, its new chunks.
Accepted = tuple["Pending[Turn, SavedTurn]", Manifest, list[tuple[bytes, Any]]]


class Sharing(abc.ABC):
    """How this store shares sessions with other daemons (module docstring: the contract)."""

    #: The tiers every save needs besides the durable one (health: NOT_SERVING while one fails).
    tiers: tuple[str, ...] = ()
    #: Whether reading a manifest may take a network round trip (a catch-up goes first).
    reads_remote: bool = False

    @abc.abstractmethod
    def publish_turns(self, accepted: list[Accepted], store: TieredStore,
                      starts: Mapping[SessionRef, int]) -> list[Accepted]:
        """Publish each accepted turn (``starts``: of each append's session, the chunk count of the
        version it extends); fail (``Pending.fail``) those that cannot be, return the rest."""

    @abc.abstractmethod
    def publish(self, m: Manifest, deleted: bool = False) -> None:
        """Publish a new version of one session (``deleted``: its removal), or raise: then it is not applied."""

    @abc.abstractmethod
    def forget(self, refs: Sequence[SessionRef]) -> None:
        """What was published for ``refs`` did not commit locally: the next read catches up with it."""

    @abc.abstractmethod
    def expired(self, refs: Sequence[SessionRef]) -> None:
        """The index dropped ``refs`` (their TTL passed): keep no more of them than it takes not to index
        them again at the next catch-up."""

    @abc.abstractmethod
    def advance(self, ref: SessionRef, gen: int) -> bool:
        """Record that the index holds version ``gen`` of ``ref``; False if it holds it or a newer one."""

    @abc.abstractmethod
    def held(self, keys: Sequence[bytes]) -> set[bytes]:
        """Which of ``keys`` the shared tier holds: a commit counts them as stored."""

    @abc.abstractmethod
    def read_ahead(self, keys: Sequence[bytes], store: TieredStore) -> contextlib.AbstractContextManager[None]:
        """For a load of ``keys``: fetch ahead the chunks only the shared tier holds, while the context is open."""

    @abc.abstractmethod
    def catch_up_session(self, ref: SessionRef) -> list[Update]:
        """The session's shared version, if newer than the one the index holds."""

    @abc.abstractmethod
    def catch_up(self, namespace: str | None) -> list[Update]:
        """Every shared version of ``namespace`` (None: of every tenant) newer than the index's."""


class NoSharing(Sharing):
    """A store of its own: nothing is published, nothing is caught up with."""

    def publish_turns(self, accepted: list[Accepted], store: TieredStore,
                      starts: Mapping[SessionRef, int]) -> list[Accepted]:
        return accepted

    def publish(self, m: Manifest, deleted: bool = False) -> None:
        return None

    def forget(self, refs: Sequence[SessionRef]) -> None:
        return None

    def expired(self, refs: Sequence[SessionRef]) -> None:
        return None

    def advance(self, ref: SessionRef, gen: int) -> bool:
        return True

    def held(self, keys: Sequence[bytes]) -> set[bytes]:
        return set()

    def read_ahead(self, keys: Sequence[bytes], store: TieredStore) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def catch_up_session(self, ref: SessionRef) -> list[Update]:
        return []

    def catch_up(self, namespace: str | None) -> list[Update]:
        return []
