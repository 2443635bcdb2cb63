"""SessionStore: validation, commit, retention, dedup of shared prefixes, lookup, restart + GC,
and persistent bytes per token, over a real host + LMDB store in a tmp dir."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.format import chunk
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.layout import get_layout
from kvstore.format.manifest import Retention, manifest_key
from kvstore.store import SessionStore, bytes_per_token, open_store
from tests.helpers.store import (
    CHUNK_TOKENS,
    SSD_HEADER,
    TINY8,
    Session,
    build_session,
    check_chunk,
    count_puts,
    encode_chunk,
    load,
    save,
    store_config,
    token_stream,
)

CT = CHUNK_TOKENS
HOST, SSD = 0, 1


def session(sid: str, tokens: int, seed: int = 0, ns: str = "ns") -> Session:
    return build_session(ns, sid, token_stream(seed, tokens))


def chunk_items(ss: SessionStore, tier: int = SSD) -> set[bytes]:
    held = ss.store.tiers[tier].keys()
    return {k for k in held if len(k) == 16}


def assert_loads(ss: SessionStore, s: Session) -> None:
    """Every chunk of ``s`` loads, verified: checksum, key, token ids and entries."""
    m = ss.get(s.namespace, s.session_id)
    assert m.chunk_keys == s.keys and m.tail == s.tail and m.token_count == len(s.token_ids)
    loaded = list(load(ss, s.namespace, m.chunk_keys))
    assert [k for k, _ in loaded] == list(s.keys)
    for i, (k, blob) in enumerate(loaded):
        check_chunk(blob, s.layout, k, s.chunk_ids(i))


# -- validation -------------------------------------------------------------------------------------
def bad_calls(s: Session) -> dict[str, tuple[tuple, str]]:
    """name -> (save_chunks arguments, a regex the error message must match)."""
    lid = TINY8.layout_id
    other_ns = build_session("other", "x", s.token_ids)
    short_ids = s.token_ids[:8]
    short = encode_chunk(TINY8, chunk_key(lid, "ns", ROOT, short_ids), 0, short_ids)
    shifted = encode_chunk(TINY8, s.keys[0], CT, s.chunk_ids(0))
    tiny16 = build_session("ns", "x", s.token_ids, layout=get_layout("tiny-16"))
    corrupt = bytearray(s.blobs[1])
    corrupt[300] ^= 0x01
    return {
        "wrong key": (("ns", lid, ROOT, 0, [other_ns.blobs[0]]), "does not match its tokens"),
        "wrong parent": (("ns", lid, other_ns.keys[0], 1, [s.blobs[1]]), "chunk 1: key .* does not match"),
        "root parent mid-sequence": (("ns", lid, ROOT, 1, [s.blobs[1]]), "all-zero parent"),
        "wrong chunk size": (("ns", lid, ROOT, 0, [short]), r"holds tokens \[0, 8\), expected \[0, 16\)"),
        "wrong start": (("ns", lid, ROOT, 0, [shifted]), r"holds tokens \[16, 32\), expected \[0, 16\)"),
        "unknown layout": (("ns", bytes(range(16)), ROOT, 0, [s.blobs[0]]), "unknown layout"),
        "other layout's chunk": (("ns", lid, ROOT, 0, [tiny16.blobs[0]]), "written under layout"),
        "corrupted": (("ns", lid, s.keys[0], 1, [bytes(corrupt)]), "chunk 1: .*checksum"),
        "bad chunk after good ones": (("ns", lid, ROOT, 0, [s.blobs[0], s.blobs[1], bytes(corrupt)]),
                                      "chunk 2: .*checksum"),
        "malformed namespace": (("no/slash", lid, ROOT, 0, [s.blobs[0]]), "malformed namespace"),
    }


CASES = list(bad_calls(session("x", 3 * CT)))


@pytest.mark.parametrize("case", CASES)
def test_save_chunks_rejects_bad_input_and_stores_nothing(sessions: SessionStore, case: str) -> None:
    base = session("base", 2 * CT, seed=7)
    save(sessions, base)
    s = session("x", 3 * CT)
    args, pattern = bad_calls(s)[case]
    before = [set(t.keys()) for t in sessions.store.tiers]
    puts = count_puts(sessions.store, HOST)
    with pytest.raises(InvalidArgument, match=pattern):
        sessions.save_chunks(*args)
    assert puts == []
    assert [set(t.keys()) for t in sessions.store.tiers] == before
    assert_loads(sessions, base)


def test_commit_needs_every_chunk_and_a_valid_tail(sessions: SessionStore) -> None:
    s = session("s", 3 * CT + 5)
    sessions.save_chunks("ns", TINY8.layout_id, ROOT, 0, s.blobs[:2])
    with pytest.raises(FailedPrecondition, match="1 referenced chunks are not stored"):
        sessions.commit(s.manifest())
    with pytest.raises(NotFound):
        sessions.get("ns", "s")
    sessions.save_chunks("ns", TINY8.layout_id, s.keys[1], 2, s.blobs[2:])
    other = session("t", 3 * CT + 7, seed=1)
    m = s.manifest()
    for bad in (other.tail, s.blobs[0], s.tail[:-1]):
        with pytest.raises(InvalidArgument, match="trailing span"):
            sessions.commit(type(m)(**{**m.__dict__, "tail": bad}))
    assert sessions.list_sessions() == []
    sessions.commit(m)
    assert_loads(sessions, s)


# -- session lifecycle ------------------------------------------------------------------------------
def test_commit_get_list_delete(sessions: SessionStore) -> None:
    a, b = session("a", 3 * CT + 3, seed=1), session("b", 2 * CT, seed=2)
    c = session("c", CT, seed=3, ns="other")
    for s in (a, b, c):
        save(sessions, s, metadata={"owner": s.session_id})
    m = sessions.get("ns", "a")
    assert (m.token_count, m.tail_tokens, m.metadata) == (3 * CT + 3, 3, {"owner": "a"})
    assert m.last_token_ids == tuple(int(t) for t in a.token_ids)
    assert [x.session_id for x in sessions.list_sessions()] == ["a", "b", "c"]
    assert [x.session_id for x in sessions.list_sessions("ns")] == ["a", "b"]
    assert sessions.delete("ns", "a") == 3
    with pytest.raises(NotFound):
        sessions.get("ns", "a")
    with pytest.raises(NotFound):
        sessions.delete("ns", "a")
    assert all(sessions.store.where(k) == [] for k in a.keys)
    assert sessions.store.get_meta(manifest_key("ns", "a")) is None
    assert_loads(sessions, b)
    assert_loads(sessions, c)
    with pytest.raises(InvalidArgument):
        sessions.get("ns", "../etc")


def test_recommit_keeps_created_at_and_frees_replaced_chunks(sessions: SessionStore) -> None:
    v1 = session("s", 3 * CT, seed=1)
    save(sessions, v1, now=100.0)
    v2 = session("s", 2 * CT, seed=2)  # a different history under the same id
    save(sessions, v2, now=200.0)
    m = sessions.get("ns", "s")
    assert (m.created_at, m.updated_at, m.chunk_keys) == (100.0, 200.0, v2.keys)
    assert chunk_items(sessions) == set(v2.keys) and chunk_items(sessions, HOST) == set(v2.keys)


def test_pinned_session_stays_in_host_until_unpinned(tmp_path: Path) -> None:
    size = chunk.encoded_size(TINY8, CT)
    ss = open_store(store_config(tmp_path, host_capacity=4 * size))
    try:
        pinned = session("pinned", 2 * CT, seed=1)
        save(ss, pinned, retention=Retention(pinned=True))
        for i in range(4):
            save(ss, session(f"other{i}", 2 * CT, seed=10 + i))
            assert all(ss.store.where(k)[0] == "host" for k in pinned.keys)
            assert ss.store.tiers[HOST].stats().usage.items <= 4
        assert ss.pinned_keys() == set(pinned.keys)
        ss.touch("ns", "pinned", Retention(pinned=False))
        assert ss.pinned_keys() == set()
        save(ss, session("last", 4 * CT, seed=99))
        assert [ss.store.where(k) for k in pinned.keys] == [["ssd"]] * 2
        assert_loads(ss, pinned)
    finally:
        ss.store.close()


def test_ttl_expiry_with_an_injected_clock(sessions: SessionStore) -> None:
    now = [1000.0]
    sessions.clock = lambda: now[0]
    s = session("s", 2 * CT, seed=1)
    keep = session("keep", 2 * CT, seed=2)
    save(sessions, s, retention=Retention(ttl_s=10), now=1000.0)
    save(sessions, keep, retention=Retention(pinned=True, ttl_s=10), now=1000.0)
    now[0] = 1009.0
    assert sessions.get("ns", "s").retention.ttl_s == 10
    sessions.touch("ns", "s", Retention(ttl_s=10))  # restarts the clock: alive until 1019
    now[0] = 1018.0
    assert sessions.expire() == 0
    assert [m.session_id for m in sessions.list_sessions()] == ["keep", "s"]
    now[0] = 1019.5
    with pytest.raises(NotFound):
        sessions.get("ns", "s")
    assert [m.session_id for m in sessions.list_sessions()] == ["keep"]  # pinned: never expires
    assert sessions.expire() == 1
    assert chunk_items(sessions) == set(keep.keys)
    assert sessions.store.get_meta(manifest_key("ns", "s")) is None


# -- dedup and sharing ------------------------------------------------------------------------------
def test_incremental_save_sends_only_new_chunks(sessions: SessionStore) -> None:
    full = session("s", 6 * CT + 3)
    v1 = build_session("ns", "s", full.token_ids[: 4 * CT + 1])
    puts = count_puts(sessions.store, SSD)
    save(sessions, v1)
    assert [k for k in puts if len(k) == 16] == list(v1.keys)
    puts.clear()
    # Only chunks 4 and 5 travel; they chain onto chunk 3's key.
    res = sessions.save_chunks("ns", TINY8.layout_id, full.keys[3], 4, full.blobs[4:])
    assert (res.keys, res.written) == (list(full.keys[4:]), 2)
    sessions.commit(full.manifest())
    assert [k for k in puts if len(k) == 16] == list(full.keys[4:])
    puts.clear()
    res = sessions.save_chunks("ns", TINY8.layout_id, ROOT, 0, full.blobs)  # a client resending everything
    assert (res.keys, res.written) == (list(full.keys), 0)
    sessions.commit(full.manifest())
    assert [k for k in puts if len(k) == 16] == []
    assert sessions.store.tiers[SSD].stats().usage.items == 6  # six chunks; the manifest is in the meta keyspace
    assert list(sessions.store.tiers[SSD].meta().keys()) == [manifest_key("ns", "s")]
    assert_loads(sessions, full)


def test_shared_prefix_is_stored_once_and_survives_deletes(sessions: SessionStore) -> None:
    prefix = token_stream(1, 3 * CT)
    a = build_session("ns", "a", np.concatenate([prefix, token_stream(2, 2 * CT + 5)]))
    b = build_session("ns", "b", np.concatenate([prefix, token_stream(3, CT + 9)]))
    assert a.keys[:3] == b.keys[:3] and a.keys[3] != b.keys[3]
    save(sessions, a)
    save(sessions, b)
    assert chunk_items(sessions) == set(a.keys) | set(b.keys) and len(chunk_items(sessions)) == 6
    assert len(sessions.live_chunks()) == 6
    assert sessions.delete("ns", "a") == 2  # only a's own chunks go
    assert chunk_items(sessions) == set(b.keys)
    assert_loads(sessions, b)
    assert sessions.lookup("ns", TINY8.layout_id, a.token_ids).cached_tokens == 3 * CT
    assert sessions.delete("ns", "b") == 4
    assert chunk_items(sessions) == set() and chunk_items(sessions, HOST) == set()


def test_namespaces_isolate(sessions: SessionStore) -> None:
    ids = token_stream(5, 3 * CT)
    a, b = build_session("alpha", "s", ids), build_session("beta", "s", ids)
    assert not set(a.keys) & set(b.keys)
    save(sessions, a)
    assert sessions.lookup("beta", TINY8.layout_id, ids).cached_tokens == 0
    with pytest.raises(NotFound):
        sessions.get("beta", "s")
    save(sessions, b)
    assert len(chunk_items(sessions)) == 6
    sessions.delete("alpha", "s")
    assert_loads(sessions, b)


# -- lookup -----------------------------------------------------------------------------------------
def test_longest_prefix_lookup(sessions: SessionStore) -> None:
    s = session("s", 5 * CT + 7)
    save(sessions, s)
    lid = TINY8.layout_id
    full = sessions.lookup("ns", lid, s.token_ids)
    assert (full.cached_tokens, full.requested_tokens, full.chunks, full.tiers) == (5 * CT, 5 * CT + 7, 5, {"host": 5})
    longer = np.concatenate([s.token_ids, token_stream(9, 3 * CT)])
    assert sessions.lookup("ns", lid, longer).cached_tokens == 5 * CT
    diverged = s.token_ids.copy()
    diverged[2 * CT + 3] += 1
    part = sessions.lookup("ns", lid, diverged)
    assert (part.cached_tokens, part.chunks, part.tiers) == (2 * CT, 2, {"host": 2})
    miss_ids = s.token_ids.copy()
    miss_ids[0] += 1
    miss = sessions.lookup("ns", lid, miss_ids)
    assert (miss.cached_tokens, miss.chunks, miss.tiers) == (0, 0, {})
    assert sessions.lookup("ns", lid, s.token_ids[: CT - 1]).cached_tokens == 0
    h = sessions.hits
    assert (h.lookups, h.hit_tokens) == (5, 5 * CT + 5 * CT + 2 * CT)
    with pytest.raises(InvalidArgument):
        sessions.lookup("ns", bytes(16), s.token_ids)


def test_evict_to_ssd_then_lookup_reports_ssd(sessions: SessionStore) -> None:
    s = session("s", 5 * CT)
    save(sessions, s)
    lid = TINY8.layout_id
    assert sessions.evict("ns", "s", "ssd") == 5
    assert sessions.lookup("ns", lid, s.token_ids).tiers == {"ssd": 5}
    assert chunk_items(sessions, HOST) == set()
    loaded = [k for k, blob in load(sessions, "ns", s.keys[:2]) if blob is not None]
    assert loaded == list(s.keys[:2])
    assert sessions.lookup("ns", lid, s.token_ids).tiers == {"host": 2, "ssd": 3}
    assert (sessions.hits.loads, sessions.hits.loaded_chunks, sessions.hits.missed_chunks) == (1, 2, 0)
    with pytest.raises(InvalidArgument, match="unknown tier"):
        sessions.evict("ns", "s", "tape")


# -- restart and garbage ----------------------------------------------------------------------------
def test_restart_finds_committed_sessions_and_collects_garbage(tmp_path: Path) -> None:
    cfg = store_config(tmp_path, zstd_level=3)
    ss = open_store(cfg)
    saved = [session(f"s{i}", (i + 1) * CT + i, seed=i) for i in range(3)]
    for i, s in enumerate(saved):
        save(ss, s, version=i, retention=Retention(pinned=i == 0))
    before = {m.session_id: m for m in ss.list_sessions()}
    orphan = session("crashed", 3 * CT, seed=50)
    ss.save_chunks("ns", TINY8.layout_id, ROOT, 0, orphan.blobs)  # saved, never committed
    assert all(ss.store.where(k) for k in orphan.keys)
    ss.store.close()

    ss = open_store(cfg)
    try:
        assert {m.session_id: m for m in ss.list_sessions()} == before
        for s in saved:
            assert_loads(ss, s)
        assert all(ss.store.where(k) == [] for k in orphan.keys)  # open_store collected them
        assert ss.pinned_keys() == set(saved[0].keys)
        late = session("late", 2 * CT, seed=51)
        ss.save_chunks("ns", TINY8.layout_id, ROOT, 0, late.blobs)
        assert ss.collect_garbage() == 2
        assert ss.collect_garbage() == 0
        assert chunk_items(ss) == {k for s in saved for k in s.keys}
    finally:
        ss.store.close()


def test_a_16_byte_manifest_key_survives_two_restarts(tmp_path: Path) -> None:
    """Issue 8, defect 1: ``m:alpha/long-32k`` is 16 bytes, like a chunk key. Startup GC once took
    it for an orphan chunk and deleted it; after the next restart the session was gone."""
    assert len(manifest_key("alpha", "long-32k")) == 16
    cfg = store_config(tmp_path)
    s = session("long-32k", 4 * CT + 3, ns="alpha")
    ss = open_store(cfg)
    save(ss, s)
    ss.store.close()
    for _ in range(2):
        ss = open_store(cfg)
        try:
            assert [m.session_id for m in ss.list_sessions("alpha")] == ["long-32k"]
            assert_loads(ss, s)
        finally:
            ss.store.close()


def test_an_old_format_data_dir_opens_with_every_session(tmp_path: Path) -> None:
    """The old format kept manifests among the chunks, framed like them: the first open moves them
    to the meta sub-database (one transaction), and every session, 16-byte key or not, is there."""
    cfg = store_config(tmp_path)
    olds = [session("long-32k", 3 * CT + 1, ns="alpha"), session("another-session", 2 * CT, seed=3)]
    ss = open_store(cfg)
    for s in olds:
        save(ss, s)
    ss.store.close()
    env = lmdb.open(str(tmp_path / "ssd"), max_dbs=8)  # rewrite it as the old format had it
    chunks, meta = env.open_db(b"chunks"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        for key, value in list(txn.cursor(db=meta)):
            txn.put(key, SSD_HEADER.pack(0, len(value), len(value)) + value, db=chunks)
        txn.drop(meta, delete=True)
    env.close()
    for _ in range(2):  # the second open finds nothing left to migrate
        ss = open_store(cfg)
        try:
            assert sorted(m.session_id for m in ss.list_sessions()) == ["another-session", "long-32k"]
            for s in olds:
                assert_loads(ss, s)
            assert chunk_items(ss) == {k for s in olds for k in s.keys}
            assert ss.store.tiers[SSD].stats().usage.items == sum(len(s.keys) for s in olds)
        finally:
            ss.store.close()


# -- bytes per token --------------------------------------------------------------------------------
@pytest.mark.parametrize("zstd_level", [0, 3])
def test_bytes_per_token_matches_the_formula(tmp_path: Path, zstd_level: int) -> None:
    lay, ct, n_chunks, tail = get_layout("tiny-16"), 1024, 8, 512
    ss = open_store(store_config(tmp_path, zstd_level=zstd_level, chunk_tokens=ct))
    try:
        s = build_session("ns", "s", token_stream(0, n_chunks * ct + tail), layout=lay, chunk_tokens=ct)
        save(ss, s)
        bpt = bytes_per_token(ss)
        tokens = n_chunks * ct + tail
        assert (bpt.tokens, bpt.sessions, bpt.unique_chunks) == (tokens, 1, n_chunks)
        assert bpt.payload == tokens * lay.bytes_per_token  # exactly the layout formula
        assert bpt.formula == float(lay.bytes_per_token) == 222.5
        per_chunk = chunk.encoded_size(lay, ct) - lay.chunk_payload_bytes(ct)
        assert bpt.chunk_overhead == n_chunks * per_chunk
        assert bpt.manifests == len(ss.get("ns", "s").encode()) - lay.chunk_payload_bytes(tail)
        assert bpt.raw == sum(len(b) for b in s.blobs) + len(ss.get("ns", "s").encode())
        ssd = ss.store.tiers[SSD]
        held = list(ssd.keys())
        manifest = ssd.meta().get(manifest_key("ns", "s"))  # raw in the meta sub-database
        assert manifest is not None
        assert bpt.stored == sum(ssd.size_of(k) for k in held) + len(manifest)
        measured = Fraction(bpt.stored + bpt.lmdb_overhead, tokens)
        assert float(measured) == pytest.approx(bpt.measured)
        if zstd_level == 0:
            assert bpt.stored == bpt.raw + 9 * n_chunks  # the ssd record header, nothing else
            assert 1 < bpt.measured / bpt.formula < 1.04, bpt
        else:
            assert bpt.stored < bpt.raw  # scales and token ids compress; FP4 codes do not
            assert bpt.measured < (bpt.raw + bpt.lmdb_overhead) / tokens
    finally:
        ss.store.close()


def test_bytes_per_token_counts_shared_chunks_once(sessions: SessionStore) -> None:
    prefix = token_stream(1, 4 * CT)
    a = build_session("ns", "a", np.concatenate([prefix, token_stream(2, CT)]))
    b = build_session("ns", "b", prefix)
    save(sessions, a)
    save(sessions, b)
    bpt = bytes_per_token(sessions)
    assert (bpt.tokens, bpt.unique_chunks, bpt.sessions) == (5 * CT, 5, 2)
    assert bpt.payload == 5 * CT * TINY8.bytes_per_token
