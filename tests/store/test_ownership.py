"""A chunk belongs to the namespace that saved it, and a hit is what its key names (issue 8).

- reads, lookups and commits see only their own namespace's chunks; another namespace's chunk
  is answered exactly as an absent one, and a read never deletes what it does not own (2-4);
- a chunk that claims key K but holds other token ids (valid checksum) is never served (7);
- a save whose durable write fails leaves nothing behind in faster tiers (8);
- a manifest whose chunks are out of order, repeated or of another layout does not commit (9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvstore.format.keys import ROOT, chain_keys
from kvstore.format.layout import get_layout
from kvstore.format.manifest import manifest_key
from kvstore.store import SessionStore
from kvstore.tiers import TierError
from tests.helpers.store import TINY8, Session, build_session, encode_chunk, load, save, token_stream

CT = 16
HOST, SSD = 0, 1


def session(ns: str, sid: str, tokens: int, seed: int = 0) -> Session:
    return build_session(ns, sid, token_stream(seed, tokens))


def stored(ss: SessionStore) -> list[set[bytes]]:
    return [set(t.keys()) for t in ss.store.tiers] + [set(ss.store.tiers[SSD].meta().keys())]


def counters(ss: SessionStore) -> list[int]:
    """Every hit and tier counter, flattened."""
    tiers = [v for c in ss.store.counters.values() for v in dataclasses.astuple(c) if isinstance(v, int)]
    return [*dataclasses.astuple(ss.hits), *tiers]


def tier_calls(ss: SessionStore) -> list[str]:
    """Record every tier operation the tiered store makes from now on."""
    calls: list[str] = []
    for slot in ss.store._slots:  # every tier call goes through its slot's call()
        real = slot.call

        def spy(what: str, op: Callable[..., object], *args: object, real: Callable[..., object] = real,
                **kwargs: object) -> object:
            calls.append(what)
            return real(what, op, *args, **kwargs)

        slot.call = spy  # type: ignore[method-assign]
    return calls


# -- 2-4: ownership ---------------------------------------------------------------------------------
def test_another_namespaces_chunks_load_exactly_as_absent_ones(sessions: SessionStore) -> None:
    """Issue 8, defect 2: A once read B's chunks byte-exact by naming their keys."""
    b = session("B", "secret", 3 * CT, seed=1)
    save(sessions, b)
    absent = [bytes([i]) * 16 for i in range(len(b.keys))]
    before = stored(sessions)
    deltas, touched = [], []
    for keys in (absent, list(b.keys)):  # keys nobody has, then B's chunks, both asked for by A
        c0, calls = counters(sessions), tier_calls(sessions)
        assert [blob for _, blob in load(sessions, "A", keys)] == [None] * len(keys)
        deltas.append([y - x for x, y in zip(c0, counters(sessions))])
        touched.append(calls)
    assert deltas[0] == deltas[1]  # the same counters moved by the same amounts
    assert touched == [[], []]  # neither touched a tier: the same path, whatever B holds
    assert stored(sessions) == before
    assert all(blob is not None for _, blob in load(sessions, "B", b.keys))  # B still reads them


def test_a_read_never_deletes_what_it_does_not_own(sessions: SessionStore) -> None:
    """LoadChunks(namespace="B", keys=[b"m:A/<session>"]) once took A's manifest for a corrupt
    chunk and deleted it; and B's chunks must not go when A names them."""
    a = session("A", "s", 2 * CT, seed=2)
    save(sessions, a)
    before = stored(sessions)
    weird = [manifest_key("A", "s"), *a.keys, b"m:A/s" + bytes(11)]
    assert [blob for _, blob in load(sessions, "B", weird)] == [None] * len(weird)
    assert stored(sessions) == before
    assert all(c.verify_failures == 0 for c in sessions.store.counters.values())
    assert sessions.get("A", "s").chunk_keys == a.keys


def test_commit_answers_another_namespaces_chunks_as_not_stored(sessions: SessionStore) -> None:
    """Issue 8, defect 4: naming B's chunks and naming random keys must give one answer."""
    b = session("B", "s", 2 * CT, seed=5)
    save(sessions, b)
    forged = dataclasses.replace(sessions.get("B", "s"), namespace="A")  # B's chunk keys, in A
    random_keys = dataclasses.replace(forged, chunk_keys=(bytes(range(16)), bytes(range(1, 17))))
    messages = []
    for m in (forged, random_keys):
        with pytest.raises(FailedPrecondition) as e:
            sessions.commit(m)
        messages.append(str(e.value).replace(m.chunk_keys[0].hex(), "K"))
    assert messages[0] == messages[1] == ("2 referenced chunks are not stored in namespace 'A' (first: K); "
                                          "save them before committing")
    with pytest.raises(NotFound):
        sessions.get("A", "s")


def test_lookup_counts_only_indexed_chunks_of_the_namespace(sessions: SessionStore) -> None:
    ids = token_stream(7, 3 * CT)
    keys = chain_keys(TINY8.layout_id, "A", ids, CT)
    # A chunk planted in a tier (e.g. a shared Redis) that no save of this store validated is not counted.
    sessions.store.tiers[SSD].put_many([(keys[0], encode_chunk(TINY8, keys[0], 0, ids[:CT]))])
    assert sessions.lookup("A", TINY8.layout_id, ids).cached_tokens == 0
    a = build_session("A", "s", ids)
    save(sessions, a)
    assert sessions.lookup("A", TINY8.layout_id, ids).cached_tokens == 3 * CT
    assert sessions.lookup("B", TINY8.layout_id, ids).cached_tokens == 0


# -- 7: token ids are checked on a hit --------------------------------------------------------------
def test_a_chunk_holding_other_tokens_under_a_key_is_never_served(sessions: SessionStore) -> None:
    s = session("A", "s", 3 * CT, seed=3)
    save(sessions, s)
    load(sessions, "A", s.keys)  # promote into host
    other = token_stream(99, CT)
    forged = encode_chunk(TINY8, s.keys[1], CT, other)  # claims key 1, right span, valid checksum
    for tier in (HOST, SSD):
        sessions.store.tiers[tier].put_many([(s.keys[1], forged)])
    loaded = [blob for _, blob in load(sessions, "A", s.keys)]
    assert loaded[0] is not None and loaded[2] is not None
    assert loaded[1] is None
    assert [sessions.store.counters[n].verify_failures for n in ("host", "ssd")] == [1, 1]
    assert sessions.store.where(s.keys[1]) == []  # both bad copies dropped
    assert sessions.lookup("A", TINY8.layout_id, s.token_ids).cached_tokens == CT


# -- 8: a failed save leaves nothing behind ---------------------------------------------------------
def test_a_save_failing_on_the_durable_tier_leaves_nothing_in_faster_ones(sessions: SessionStore) -> None:
    base = session("A", "base", 2 * CT, seed=4)
    save(sessions, base)
    load(sessions, "A", base.keys)  # in host and ssd
    longer = build_session("A", "longer", token_stream(4, 4 * CT))
    cached = longer.keys[2]  # a chunk host already held before this save (e.g. promoted from Redis)
    sessions.store.tiers[HOST].put_many([(cached, longer.blobs[2])])

    def broken(items: object) -> None:
        raise TierError("ssd tier: put_many failed: simulated I/O error")

    sessions.store.tiers[SSD].put_many = broken  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match="simulated"):
        sessions.save_chunks("A", TINY8.layout_id, ROOT, 0, longer.blobs)
    host = set(sessions.store.tiers[HOST].keys())
    assert host == {*base.keys, cached}  # the new chunk 3 is gone; what was there before stays
    assert sessions.lookup("A", TINY8.layout_id, longer.token_ids).cached_tokens == 2 * CT
    assert [blob is None for _, blob in load(sessions, "A", longer.keys)] == [False, False, True, True]
    with pytest.raises(FailedPrecondition, match="not stored"):
        sessions.commit(longer.manifest())


# -- 9: a manifest must be consistent with its chunks -----------------------------------------------
def test_inconsistent_manifests_do_not_commit(sessions: SessionStore) -> None:
    s = session("A", "s", 3 * CT + 2, seed=6)
    sessions.save_chunks("A", TINY8.layout_id, ROOT, 0, s.blobs)
    m = s.manifest()
    k = s.keys
    for bad, why in (((k[1], k[0], k[2]), "out of place"), ((k[0], k[0], k[2]), "out of place"),
                     ((k[0], k[2], k[1]), "out of place")):
        with pytest.raises(InvalidArgument, match=why):
            sessions.commit(dataclasses.replace(m, chunk_keys=bad))
    # chunks of another layout, under a manifest of this one
    t16 = get_layout("tiny-16")
    other = build_session("A", "t", s.token_ids, layout=t16)
    sessions.save_chunks("A", t16.layout_id, ROOT, 0, other.blobs)
    with pytest.raises(InvalidArgument, match="layout"):
        sessions.commit(dataclasses.replace(m, chunk_keys=other.keys))
    assert sessions.list_sessions() == []
    sessions.commit(m)
    assert sessions.get("A", "s").chunk_keys == k
