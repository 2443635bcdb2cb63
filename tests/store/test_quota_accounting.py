"""Per-namespace ssd quotas on a real store (host tier + LMDB), what they count: in write-back mode
the chunks on their way to the ssd tier (pending until flushed, then as the ssd tier holds them,
never twice), and for a whole save that replaces a version, its net change (its new bytes less what
the chunks only the replaced version used take); and the prefetch cap per namespace as a setting."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.errors import ResourceExhausted
from kvstore.format.keys import ROOT
from kvstore.store import SessionStore
from kvstore.store.config import StoreConfig
from kvstore.store.quotas import Quota, Quotas
from kvstore.store.sessions.prefetch import PrefetchConfig, Prefetcher
from kvstore.store.tiered.ledger import UNOWNED, Ledger
from kvstore.tiers.config import InvalidSetting
from tests.helpers.store import CHUNK_TOKENS, Session, build_session, make_tiered, store_config, token_stream

NS = "t"


def quota_store(root: Path, ssd_bytes: int, write_mode: str = "through", host_capacity: int = 0) -> SessionStore:
    """A session store whose namespace ``NS`` has an ssd quota of ``ssd_bytes``."""
    config = replace(store_config(root, host_capacity=host_capacity, write_mode=write_mode),
                     quotas=Quotas({NS: Quota(ssd_bytes=ssd_bytes)}))
    return SessionStore(make_tiered(config), config)


def session(session_id: str, seed: int, chunks: int) -> Session:
    return build_session(NS, session_id, token_stream(seed, CHUNK_TOKENS * chunks + 3))


def sent(s: Session) -> int:
    """The bytes of ``s``'s chunks as sent."""
    return sum(len(b) for b in s.blobs)


def save_chunks(ss: SessionStore, s: Session) -> None:
    ss.save_chunks(s.namespace, s.layout.layout_id, ROOT, 0, s.blobs)


def check_counted_once(ss: SessionStore, *saved: Session) -> None:
    """What the ledger counts for ``NS`` is what the tiers hold of ``saved``'s chunks: each dirty one
    (in the host tier, not on the ssd tier) at its size as sent, each on the ssd tier as the tier
    stores it, none both."""
    store, ledger = ss.store, ss.store.ledger
    ssd = store.tiers[store.durable]
    on_ssd = set(ssd.keys())
    blobs = {k: b for s in saved for k, b in zip(s.keys, s.blobs)}
    dirty = [k for k in store.chunk_keys(local_only=True) if k not in on_ssd and store.holds_durably(k)]
    assert ledger.pending(NS) == sum(len(blobs[k]) for k in dirty)
    assert ledger.used(ssd.name, NS) == sum(ssd.size_of(k) or 0 for k in on_ssd)
    assert ledger.used_durably(NS) == ledger.pending(NS) + ledger.used(ssd.name, NS)


def test_write_back_chunks_count_toward_the_ssd_quota_before_they_are_flushed(tmp_path: Path) -> None:
    a, b = session("a", 1, 8), session("b", 2, 8)
    quota = sent(a) * 3 // 2
    ss = quota_store(tmp_path, quota, write_mode="back")
    try:
        save_chunks(ss, a)  # in the host tier only: not on the ssd tier yet
        ledger = ss.store.ledger
        assert ledger.used("ssd", NS) == 0 and ledger.pending(NS) == sent(a)
        assert ss.admission.usage([NS])[0].ssd_bytes == sent(a)
        with pytest.raises(ResourceExhausted) as e:  # a's backlog and b's chunks: past the quota
            save_chunks(ss, b)
        assert f"namespace {NS!r}" in str(e.value) and f"its {quota}" in str(e.value), str(e.value)
        assert f"quotas.{NS}.ssd_bytes" in str(e.value)
        assert ledger.pending(NS) == sent(a)  # b stored nothing
        check_counted_once(ss, a)
        ss.commit(a.manifest())  # flushed before its commit: counted as the ssd tier holds it, once
        assert ledger.pending(NS) == 0 and ledger.used_durably(NS) == ledger.used("ssd", NS) > 0
        assert ss.admission.usage([NS])[0].ssd_bytes == ledger.used("ssd", NS)
        check_counted_once(ss, a)
    finally:
        ss.close()


def test_the_ledger_counts_a_pending_chunk_once_whoever_claims_it_and_wherever_it_goes() -> None:
    ledger = Ledger(["host", "ssd"])
    ledger.pend([(b"k1", 100), (b"k2", 50)])  # not claimed yet: the unowned namespace's
    assert ledger.pending(UNOWNED) == 150 and ledger.pending(NS) == 0
    ledger.claim([b"k1", b"k2"], NS)
    assert ledger.pending(UNOWNED) == 0 and ledger.used_durably(NS) == 150
    ledger.put("host", [(b"k1", 100)])  # a faster tier: still pending
    assert ledger.used_durably(NS) == 150
    ledger.put("ssd", iter([(b"k1", 90)]))  # flushed (compressed): counted as the ssd tier holds it
    assert ledger.pending(NS) == 50 and ledger.used_durably(NS) == 140 and ledger.durable_bytes([b"k1", b"k2"]) == 140
    ledger.pend([(b"k1", 100)])  # already durable: not pending again
    assert ledger.used_durably(NS) == 140
    ledger.forget([b"k2"])  # deleted before it was flushed
    assert ledger.pending(NS) == 0 and ledger.used_durably(NS) == 90


def test_write_back_chunks_demoted_or_collected_stop_being_pending(tmp_path: Path) -> None:
    """Demotion flushes dirty chunks (counted on the ssd tier from then on); collecting uncommitted
    ones drops them: either way the namespace's bytes are what the tiers hold, each chunk once."""
    sessions = [session(f"s{i}", 10 + i, 8) for i in range(4)]
    ss = quota_store(tmp_path, 1 << 30, write_mode="back", host_capacity=sent(sessions[0]) * 2)
    try:
        for s in sessions:
            save_chunks(ss, s)
            check_counted_once(ss, *sessions)
        ledger = ss.store.ledger
        assert 0 < ledger.pending(NS) < sum(map(sent, sessions)) and ledger.used("ssd", NS) > 0  # some demoted
        ss.commit(sessions[0].manifest())
        check_counted_once(ss, *sessions)
        ss.collect_garbage()  # the uncommitted ones
        assert ledger.pending(NS) == 0
        check_counted_once(ss, *sessions)
    finally:
        ss.close()


def save_whole(ss: SessionStore, s: Session) -> None:
    """One turn: every chunk of ``s`` and its manifest, replacing whatever version is stored."""
    ss.save_session(s.namespace, s.layout.layout_id, ROOT, 0, s.blobs, s.manifest())


def test_a_whole_save_that_replaces_a_version_is_checked_by_its_net_change(tmp_path: Path) -> None:
    """At its quota, a namespace re-saves its session shorter (all new chunks): the chunks only the old
    version used are deleted in the same commit, so the save fits; one that grows past it is refused."""
    old, shorter, longer = session("a", 1, 8), session("a", 2, 6), session("a", 3, 16)
    quota = sent(old) * 6 // 5  # room for the old version, not for it and the shorter one beside it
    ss = quota_store(tmp_path, quota)
    try:
        save_whole(ss, old)
        ledger = ss.store.ledger
        assert ledger.used("ssd", NS) + sent(shorter) > quota  # the gross check would refuse it
        save_whole(ss, shorter)
        assert ss.get(NS, "a").chunk_keys == shorter.keys
        assert not any(ss.store.holds_durably(k) for k in old.keys)  # freed in the same commit
        assert ledger.used("ssd", NS) == sum(ss.store.tiers[1].size_of(k) for k in shorter.keys) <= quota
        with pytest.raises(ResourceExhausted) as e:  # net growth past the quota
            save_whole(ss, longer)
        msg = str(e.value)
        assert f"namespace {NS!r}" in msg and f"its {quota}" in msg and "freed by the version it replaces" in msg
        assert ss.get(NS, "a").chunk_keys == shorter.keys  # nothing changed
        save_whole(ss, old)  # back to the first version: fits again
        assert ss.get(NS, "a").chunk_keys == old.keys
    finally:
        ss.close()


def test_chunks_another_session_still_uses_are_not_counted_as_freed(tmp_path: Path) -> None:
    """A re-save frees only the chunks no other session names: a fork sharing the first half keeps
    it, so re-saving the session with all new chunks frees only its second half."""
    ids = token_stream(1, CHUNK_TOKENS * 8 + 3)
    old = build_session(NS, "a", ids)
    fork = build_session(NS, "fork", ids[: CHUNK_TOKENS * 4 + 3])
    assert fork.keys == old.keys[:4]
    new = session("a", 2, 8)
    quota = sent(old) * 5 // 4  # ~10 chunks: 8 held, then 8 new less 4 freed does not fit (8 freed would)
    ss = quota_store(tmp_path, quota)
    try:
        save_whole(ss, old)
        save_whole(ss, fork)  # its chunks are old's: nothing new
        ssd = ss.store.tiers[1]
        assert sent(new) <= quota  # had old's every chunk counted as freed, the save would fit
        with pytest.raises(ResourceExhausted, match="freed by the version it replaces"):
            save_whole(ss, new)
        with ss._index.write_lock:
            assert ss.admission.freed((NS, "a"), set()) == sum(ssd.size_of(k) or 0 for k in old.keys[4:])
            # a chunk another turn of the same commit names is not freed either
            assert ss.admission.freed((NS, "a"), set(old.keys[4:])) == 0
        ss.delete(NS, "fork")
        save_whole(ss, new)  # now all of old's chunks go with it
    finally:
        ss.close()


def test_a_save_that_does_not_grow_the_namespace_is_never_refused(tmp_path: Path) -> None:
    """Over its quota (lowered since it saved), a namespace may still replace a version with a smaller
    one; a new session is refused."""
    big, small = session("a", 1, 8), session("a", 2, 2)
    ss = quota_store(tmp_path, sent(big) * 2)
    save_whole(ss, big)
    ss.close()
    ss = quota_store(tmp_path, sent(big) // 2)  # the same data, the quota lowered past what it holds
    try:
        with pytest.raises(ResourceExhausted):
            save_whole(ss, session("other", 3, 2))
        save_whole(ss, small)
        assert ss.get(NS, "a").chunk_keys == small.keys
    finally:
        ss.close()


def test_the_prefetch_cap_per_namespace_is_the_stores_setting(tmp_path: Path) -> None:
    config = replace(store_config(tmp_path), max_prefetch_per_namespace=2)
    ss = SessionStore(make_tiered(config), config)
    try:
        assert Prefetcher(ss).config.max_pending_per_namespace == 2
        assert Prefetcher(ss, PrefetchConfig(max_pending_per_namespace=5)).config.max_pending_per_namespace == 5
    finally:
        ss.close()
    assert StoreConfig().max_prefetch_per_namespace == 16
    with pytest.raises(InvalidSetting, match=r"max_prefetch_per_namespace.*at least 1, got 0"):
        replace(config, max_prefetch_per_namespace=0)
    with pytest.raises(ValueError, match="max_pending_per_namespace must be at least 1, got 0"):
        PrefetchConfig(max_pending_per_namespace=0)

