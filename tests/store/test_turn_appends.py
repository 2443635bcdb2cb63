"""SessionStore.append_session: a turn named by what it adds, O(the turn) on disk (a turn record beside
the manifest), read back whole after a restart, compacted at the threshold, refused against a stale
base; over a real host + LMDB store in a tmp dir."""

from __future__ import annotations

import itertools
from pathlib import Path

import lmdb
import pytest

from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.format.manifest import Manifest
from kvstore.format.turn_record import PREFIX, Append, TurnRecord, turn_key
from kvstore.store import SessionStore, open_store
from tests.helpers.store import LAST_IDS, Session, build_session, store_config, token_stream

C = 16


def append(ss: SessionStore, s: Session, start: int, base: int) -> Manifest:
    """Append chunks ``start``.. of ``s`` (and its tail) to version ``base``."""
    a = Append(s.namespace, s.session_id, s.layout.layout_id, base, s.keys[start:], len(s.token_ids), s.tail,
               tuple(int(t) for t in s.token_ids[-LAST_IDS:]))
    return ss.append_session(s.namespace, s.layout.layout_id, s.parent(start), start, s.blobs[start:], a)[0]


def meta_records(root: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(root / "ssd"), max_dbs=4, readonly=True, lock=False)
    try:
        db = env.open_db(b"meta", create=False)
        with env.begin(db=db) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def meta_of(ss: SessionStore) -> dict[bytes, bytes]:
    """The meta records of an open store (its durable tier's, as ``meta_records`` reads a closed one's)."""
    return {k: v for k in ss.store.meta_keys(b"") if (v := ss.store.get_meta(k)) is not None}


def grown(turns: int, per: int = 2) -> list[Session]:
    ids = token_stream(7, turns * per * C + 5)
    return [build_session("ns", "a", ids[: (t + 1) * per * C + (5 if t == turns - 1 else 0)]) for t in range(turns)]


def test_appends_are_turn_records_of_the_turn_and_read_whole_after_a_restart(tmp_path: Path) -> None:
    ss = open_store(store_config(tmp_path))
    *versions, more = grown(7)
    m = ss.save_session("ns", versions[0].layout.layout_id, versions[0].parent(0), 0, versions[0].blobs,
                        versions[0].manifest())[0]
    for prev, s in itertools.pairwise(versions):
        m = append(ss, s, len(prev.keys), m.generation)
        assert m.chunk_keys == s.keys and m.tail == s.tail and ss.get("ns", "a") == m
    ss.close()
    meta = meta_records(tmp_path)
    turns = sorted(k for k in meta if k.startswith(PREFIX))
    assert turns == [turn_key("ns", "a", i) for i in range(5)]
    # each record holds its turn's keys only (2 chunks), whatever the session holds: O(the turn)
    recs = [TurnRecord.decode(meta[k]) for k in turns]
    assert [len(r.chunk_keys) for r in recs] == [2, 2, 2, 2, 2]
    sizes = [len(meta[k]) for k in turns]
    # once the last ids are 128, a record's size no longer moves as the session grows: header, 2 keys, 128 ids,
    # an empty tail (the last one carries a 5-token tail)
    assert sizes[2] == sizes[3] == 58 + 2 * 16 + 4 * LAST_IDS + len(versions[3].tail) + 8
    base = Manifest.decode(meta[b"m:ns/a"])
    assert base.chunk_keys == versions[0].keys  # the manifest on disk was written once, whole
    reopened = open_store(store_config(tmp_path))
    try:
        got = reopened.get("ns", "a")
        assert (got.chunk_keys, got.tail, got.token_count, got.generation) == (m.chunk_keys, m.tail, m.token_count,
                                                                             m.generation)
        assert got.last_token_ids == m.last_token_ids and got.created_at == m.created_at
        m2 = append(reopened, more, len(m.chunk_keys), got.generation)  # the next record follows the last one
        assert m2.chunk_keys == more.keys
    finally:
        reopened.close()
    assert turn_key("ns", "a", 5) in meta_records(tmp_path)


def test_compaction_writes_the_manifest_whole_and_drops_the_turn_records(tmp_path: Path) -> None:
    cfg = store_config(tmp_path)
    from dataclasses import replace
    ss = open_store(replace(cfg, compact_turn_keys=4))
    versions = grown(8)  # 2 keys a turn: the turns reach the base's keys (and 4) every so often
    m = ss.save_session("ns", versions[0].layout.layout_id, ROOT_OF(versions[0]), 0, versions[0].blobs,
                        versions[0].manifest())[0]
    compactions = 0
    for prev, s in itertools.pairwise(versions):
        m = append(ss, s, len(prev.keys), m.generation)
        meta = meta_of(ss)
        if not any(k.startswith(PREFIX) for k in meta):
            compactions += 1
            assert Manifest.decode(meta[b"m:ns/a"]).chunk_keys == s.keys
    assert compactions >= 2
    ss.close()
    reopened = open_store(cfg)
    try:
        assert reopened.get("ns", "a").chunk_keys == versions[-1].keys
    finally:
        reopened.close()


def ROOT_OF(s: Session) -> bytes:
    return s.parent(0)


def test_an_append_against_a_stale_base_or_naming_unstored_chunks_changes_nothing(sessions: SessionStore) -> None:
    a, b = grown(3)[:2]
    m = sessions.save_session("ns", a.layout.layout_id, a.parent(0), 0, a.blobs, a.manifest())[0]
    with pytest.raises(FailedPrecondition, match="changed through another client"):
        append(sessions, b, len(a.keys), m.generation - 1)
    no_blobs = Append("ns", "a", b.layout.layout_id, m.generation, b.keys[len(a.keys):], len(b.token_ids), b.tail,
                      tuple(int(t) for t in b.token_ids[-LAST_IDS:]))
    with pytest.raises(FailedPrecondition, match="referenced chunks are not stored"):
        sessions.append_session("ns", b.layout.layout_id, b.parent(0), 0, [], no_blobs)
    with pytest.raises(InvalidArgument):
        sessions.append_session("ns", b.layout.layout_id, b.parent(0), 0, [], Append(
            "ns", "a", b.layout.layout_id, 0, (), 0, b"", ()))
    assert sessions.get("ns", "a") == m
    m2 = append(sessions, b, len(a.keys), m.generation)  # the right base: applied
    assert m2.chunk_keys == b.keys and m2.generation > m.generation


def test_touch_and_delete_drop_the_turn_records(tmp_path: Path) -> None:
    from kvstore.format.manifest import Retention
    ss = open_store(store_config(tmp_path))
    a, b, c = grown(3)
    m = ss.save_session("ns", a.layout.layout_id, a.parent(0), 0, a.blobs, a.manifest())[0]
    m = append(ss, b, len(a.keys), m.generation)
    assert any(k.startswith(PREFIX) for k in meta_of(ss))
    t = ss.touch("ns", "a", Retention(pinned=True))
    meta = meta_of(ss)
    assert not any(k.startswith(PREFIX) for k in meta) and Manifest.decode(meta[b"m:ns/a"]) == t
    m = append(ss, c, len(b.keys), t.generation)
    assert turn_key("ns", "a", 0) in meta_of(ss)
    ss.delete("ns", "a")
    assert not [k for k in meta_of(ss) if k.startswith((PREFIX, b"m:"))]
    ss.close()


def test_the_retry_of_an_applied_append_is_answered_its_version_and_writes_nothing(tmp_path: Path) -> None:
    """An append whose answer was lost (applied, then the connection or the daemon went) is retried on the
    same base: answered the version it made, nothing written, before and after a restart; another turn on
    that base is still refused."""
    cfg = store_config(tmp_path)
    ss = open_store(cfg)
    a, b, c = grown(3)
    m = ss.save_session("ns", a.layout.layout_id, a.parent(0), 0, a.blobs, a.manifest())[0]
    made = append(ss, b, len(a.keys), m.generation)
    before = meta_of(ss)
    txns = ss.store.tiers[-1].stats(pages=True).pages.last_txnid  # type: ignore[union-attr]
    again = append(ss, b, len(a.keys), m.generation)  # the same turn, the same base: its retry
    assert again == made and ss.get("ns", "a") == made and meta_of(ss) == before
    assert ss.store.tiers[-1].stats(pages=True).pages.last_txnid == txns  # type: ignore[union-attr]  # no write
    other = Append("ns", "a", b.layout.layout_id, m.generation, c.keys[len(a.keys):], len(c.token_ids), c.tail,
                   tuple(int(t) for t in c.token_ids[-LAST_IDS:]))
    with pytest.raises(FailedPrecondition, match="changed through another client"):  # not this turn: refused
        ss.append_session("ns", c.layout.layout_id, c.parent(len(a.keys)), len(a.keys), c.blobs[len(a.keys):], other)
    ss.close()
    reopened = open_store(cfg)  # the daemon went after applying it: the retry reaches a restarted one
    try:
        assert append(reopened, b, len(a.keys), m.generation).generation == made.generation
        assert meta_of(reopened) == before
        nxt = append(reopened, c, len(b.keys), made.generation)  # and the session goes on from it
        assert nxt.chunk_keys == c.keys
        with pytest.raises(FailedPrecondition):  # the version it made is no longer current: a stale retry
            append(reopened, b, len(a.keys), m.generation)
    finally:
        reopened.close()
