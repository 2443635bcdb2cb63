"""Sessions shared through Redis and grown by appends: each turn is published as what it adds (a turn
record appended to the session's list, its new chunks only), read by another store as the turns
after its version, compacted into a new base past the threshold, refused whole to a concurrent
writer, accepted again when its answer was lost; and O(the turn) in bytes sent to Redis, bytes read
back and keys checked, from turn 10 to turn 200. Real redis-server processes, real stores."""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import redis

from kvstore.errors import FailedPrecondition, NotFound, Unavailable
from kvstore.format.keys import ROOT, chunk_key
from kvstore.format.manifest import Manifest, Retention
from kvstore.format.turn_record import Append
from kvstore.store import SessionStore, StoreConfig, open_store
from kvstore.store.sessions.shared_manifests import Known, SharedSessions
from kvstore.tiers import HostTierConfig, RedisTierConfig, SsdTierConfig, TierError
from kvstore.tiers.redis.keys import RedisKeys
from kvstore.tiers.redis.sessions import Appended, Record
from kvstore.tiers.redis.tier import RedisTier
from tests.helpers.store import LAST_IDS, TINY8, Session, build_session, encode_chunk, load, seed_of, token_stream

if TYPE_CHECKING:
    from conftest import RedisServer

C = 16
ROOT_DIR = Path(__file__).resolve().parents[2]
PER = 2  # chunks a turn adds
EXTRA = 5  # tokens of every version's trailing span


@dataclass(frozen=True)
class Version:
    """A session cut after ``n`` chunks plus a 5-token trailing span: what a client saves at one turn."""

    full: Session
    n: int
    tail: bytes

    @property
    def tokens(self) -> int:
        return self.n * C + EXTRA

    @property
    def last_ids(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self.full.token_ids[: self.tokens][-LAST_IDS:])

    def manifest(self) -> Manifest:
        return Manifest(self.full.session_id, self.full.namespace, TINY8.layout_id, self.tokens, C,
                        self.full.keys[: self.n], self.tail, self.last_ids, 0.0, 0.0)


def versions(turns: int, sid: str = "s", seed: int = 7, ns: str = "ns", ids: np.ndarray | None = None
             ) -> list[Version]:
    """Turn t's version (t = 0 .. turns - 1) holds (t + 1) x PER chunks of ``ids`` (default: seeded):
    the chunks are encoded once."""
    ids = token_stream(seed, turns * PER * C + EXTRA) if ids is None else ids[: turns * PER * C + EXTRA]
    full = build_session(ns, sid, ids, chunk_tokens=C)
    out = []
    for t in range(turns):
        n = (t + 1) * PER
        ids = full.token_ids[n * C : n * C + EXTRA]
        seed_key = chunk_key(TINY8.layout_id, ns, full.keys[n - 1] if n else ROOT, ids)
        out.append(Version(full, n, encode_chunk(TINY8, bytes(16), n * C, ids, seed=seed_of(seed_key))))
    return out


def shared(root: Path, url: str, prefix: str) -> SessionStore:
    return open_store(StoreConfig(tiers=(HostTierConfig(pin_memory=False), SsdTierConfig(path=str(root)),
                                         RedisTierConfig(url=url, namespace=prefix, share_sessions=True)),
                                  chunk_tokens=C))


def redis_tier(ss: SessionStore) -> RedisTier:
    return next(t for t in ss.store.tiers if isinstance(t, RedisTier))


def save_whole(ss: SessionStore, v: Version) -> Manifest:
    s = v.full
    return ss.save_session(s.namespace, TINY8.layout_id, ROOT, 0, s.blobs[: v.n], v.manifest())[0]


def append(ss: SessionStore, v: Version, start: int, base: int) -> Manifest:
    """Append the chunks ``start``.. of ``v`` (and its tail) to version ``base``."""
    s = v.full
    a = Append(s.namespace, s.session_id, TINY8.layout_id, base, s.keys[start : v.n], v.tokens, v.tail, v.last_ids)
    return ss.append_session(s.namespace, TINY8.layout_id, s.parent(start), start, s.blobs[start : v.n], a)[0]


def fetches(ss: SessionStore) -> list[Record | None]:
    """Record every session record the store reads from Redis (the list grows as it reads)."""
    records = redis_tier(ss).sessions()
    seen: list[Record | None] = []
    real = records.fetch_many

    def spy(tenant: str, wanted: Sequence[tuple[str, int, int]]) -> list[Record | None]:
        out = real(tenant, wanted)
        seen.extend(out)
        return out

    records.fetch_many = spy  # type: ignore[method-assign]
    return seen


def checked(ss: SessionStore) -> list[int]:
    """Record how many chunk keys each ``contains_many`` asks Redis about (the list grows)."""
    tier = redis_tier(ss)
    seen: list[int] = []
    real = tier.contains_many

    def spy(keys: Sequence[bytes]) -> list[bool]:
        seen.append(len(keys))
        return real(keys)

    tier.contains_many = spy  # type: ignore[method-assign]
    return seen


@pytest.fixture
def two(redis_url: str, tmp_path: Path) -> Iterator[tuple[SessionStore, SessionStore, str]]:
    prefix = f"st-{uuid.uuid4().hex[:8]}"
    a, b = shared(tmp_path / "a", redis_url, prefix), shared(tmp_path / "b", redis_url, prefix)
    try:
        yield a, b, prefix
    finally:
        a.close()
        b.close()


def list_len(url: str, prefix: str, sid: str = "s") -> int:
    return int(redis.Redis.from_url(url).llen(RedisKeys(prefix, tagged=False).turns("ns", sid)))


def test_a_session_grown_by_appends_is_seen_turn_by_turn_and_compacted(
        two: tuple[SessionStore, SessionStore, str], redis_url: str, tmp_path: Path) -> None:
    a, b, prefix = two
    vs = versions(30)
    read_by_b = fetches(b)
    m = save_whole(a, vs[0])
    assert b.get("ns", "s").encode() == m.encode()
    lengths = []
    for prev, v in itertools.pairwise(vs):
        m = append(a, v, prev.n, m.generation)
        lengths.append(list_len(redis_url, prefix))
        got = b.get("ns", "s")
        assert got.encode() == m.encode()  # byte for byte the writer's version
        assert got.chunk_keys == v.full.keys[: v.n] and got.tail == v.tail
    # turns went to the list, and past the threshold the list was compacted into a new base (emptied)
    assert max(lengths) >= 2 and lengths.count(0) >= 2
    assert lengths[-1] > 0
    # B read only the turn after its own version, except right after a compaction (the base whole)
    reads = [r for r in read_by_b if r is not None][1:]
    assert len(reads) == 29
    partial = [r for r in reads if not r.whole]
    assert all(len(r.turns) == 1 for r in partial)
    assert len(partial) == sum(1 for n in lengths if n > 0)
    # a store that holds nothing reads the base and every turn: the same version, its chunks from Redis
    c = shared(tmp_path / "c", redis_url, prefix)
    try:
        assert c.get("ns", "s").encode() == m.encode()
        assert [blob for _, blob in load(c, "ns", m.chunk_keys)] == list(vs[-1].full.blobs[: vs[-1].n])
    finally:
        c.close()
    # B continues the session by appends; A sees B's turns
    more = versions(32)
    mb = append(b, more[30], vs[-1].n, m.generation)
    mb = append(b, more[31], more[30].n, mb.generation)
    assert a.get("ns", "s").encode() == mb.encode()


def test_a_concurrent_append_loses_the_cas_and_nothing_is_applied(
        two: tuple[SessionStore, SessionStore, str], redis_url: str) -> None:
    a, b, prefix = two
    ours = versions(2)
    # B's turn: the same first version, then other tokens (other chunks, another trailing span)
    ids = np.concatenate([ours[0].full.token_ids[: ours[0].n * C], token_stream(8, 2 * PER * C + EXTRA)])
    theirs = versions(2, ids=ids)
    assert theirs[0].full.keys[: ours[0].n] == ours[0].full.keys[: ours[0].n]
    assert theirs[1].full.keys[ours[0].n : theirs[1].n] != ours[1].full.keys[ours[0].n : ours[1].n]
    m0 = save_whole(a, ours[0])
    assert b.get("ns", "s") == m0
    m1 = append(a, ours[1], ours[0].n, m0.generation)
    r, keys = redis.Redis.from_url(redis_url), RedisKeys(prefix, tagged=False)
    stored = (r.hgetall(keys.generations("ns")), r.get(keys.record("ns", "s")), r.lrange(keys.turns("ns", "s"), 0, -1))
    # B extends m0 too, before it saw A's turn: it loses the compare-and-set, whole
    with pytest.raises(FailedPrecondition, match="changed through another daemon"):
        _append_unseen(b, theirs[1], ours[0].n, m0.generation)
    assert (r.hgetall(keys.generations("ns")), r.get(keys.record("ns", "s")),
            r.lrange(keys.turns("ns", "s"), 0, -1)) == stored  # nothing applied in Redis
    assert b.get("ns", "s").encode() == m1.encode()  # nor in B: A's version, nothing of B's
    assert a.get("ns", "s").encode() == m1.encode()
    # loaded again, B's turn goes through (extending A's version)
    more = versions(3, ids=np.concatenate([ours[1].full.token_ids[: ours[1].n * C], token_stream(9, PER * C + EXTRA)]))
    m2 = append(b, more[2], ours[1].n, m1.generation)
    assert a.get("ns", "s").encode() == m2.encode()


def _append_unseen(ss: SessionStore, v: Version, start: int, base: int) -> Manifest:
    """Append without catching up first: the store's index still holds ``base`` (the race: both
    daemons extend the same version at once)."""
    sharing = ss._sharing  # the race needs a catch-up that comes too late
    real = sharing.catch_up_session
    sharing.catch_up_session = lambda ref: []  # type: ignore[method-assign]
    try:
        return append(ss, v, start, base)
    finally:
        sharing.catch_up_session = real  # type: ignore[method-assign]


def lose_answer(ss: SessionStore, method: str) -> None:
    """The next call of the store's ``SessionRecords.<method>`` (``append``: a turn record, ``publish``: a
    version written whole) that applies a version in Redis loses its answer: a TierError, as for a
    connection dropped after the write."""
    records = redis_tier(ss).sessions()
    real = getattr(records, method)

    def once(*args: Any) -> Any:
        out = real(*args)
        if out[0] not in (True, Appended.APPLIED):
            return out
        setattr(records, method, real)
        raise TierError("connection lost after the write (test)")

    setattr(records, method, once)


@pytest.mark.parametrize("method", ["append", "publish"])
def test_a_retry_of_an_append_whose_answer_was_lost_is_accepted(
        two: tuple[SessionStore, SessionStore, str], method: str) -> None:
    """Whether the turn was appended (a turn record) or written whole (a compaction), its retry after a
    lost answer replaces the writer's own unacknowledged version instead of conflicting with it."""
    a, b, _ = two
    vs = versions(12)
    m = save_whole(a, vs[0])
    lose_answer(a, method)
    for prev, v in itertools.pairwise(vs):
        try:
            m = append(a, v, prev.n, m.generation)
            continue
        except Unavailable as e:
            assert "nothing was acknowledged" in str(e)
        seen = b.get("ns", "s")  # applied in Redis, unacknowledged: another daemon may see it
        assert seen.chunk_keys == v.full.keys[: v.n] and seen.generation != m.generation
        m = append(a, v, prev.n, m.generation)  # the retry: the same base
        assert m.chunk_keys == v.full.keys[: v.n]
        assert b.get("ns", "s").encode() == m.encode()
        break
    else:
        pytest.fail(f"no turn was published by {method}")
    nxt = vs[v.n // PER]
    m = append(a, nxt, v.n, m.generation)  # and the turns go on from it, seen by B
    assert b.get("ns", "s").encode() == m.encode()


def test_an_expired_session_lets_go_of_its_manifest_and_is_not_indexed_again(
        two: tuple[SessionStore, SessionStore, str]) -> None:
    """Past its TTL a shared session leaves the index; the sharing layer keeps its generation only (the
    next catch-up does not index it again) and lets its manifest go; a whole save starts it over."""
    a, _, _ = two
    vs = versions(3)
    m = a.save_session("ns", TINY8.layout_id, ROOT, 0, vs[0].full.blobs[: vs[0].n],
                       replace(vs[0].manifest(), retention=Retention(ttl_s=10)))[0]
    m = append(a, vs[1], vs[0].n, m.generation)
    sharing = a._sharing
    assert isinstance(sharing, SharedSessions) and sharing.known(("ns", "s")).manifest == m
    shared_gen = sharing.known(("ns", "s")).generation  # Redis's count of the session's versions
    a.clock = lambda: time.time() + 100
    assert a.expire() == 1
    assert sharing.known(("ns", "s")) == Known(shared_gen, None)
    assert a.list_sessions("ns") == []  # a catch-up ran: the shared version, already known, stays out
    with pytest.raises(NotFound):
        a.get("ns", "s")
    again = save_whole(a, vs[2])  # saved whole again (no base): a new version, published whole
    assert again.generation > m.generation and a.get("ns", "s").chunk_keys == vs[2].full.keys[: vs[2].n]


def test_a_shared_turn_costs_what_it_adds_from_turn_10_to_turn_200(redis_server: RedisServer, tmp_path: Path) -> None:
    """Per append, the bytes Redis receives (INFO's total_net_input_bytes: the chunks and the
    compare-and-set), the bytes the reader receives catching up (total_net_output_bytes) and the
    chunk keys checked in Redis stay the turn's while the session grows 20-fold."""
    prefix = "o"
    a, b = shared(tmp_path / "a", redis_server.url, prefix), shared(tmp_path / "b", redis_server.url, prefix)
    r = redis.Redis.from_url(redis_server.url)

    def net(field: str) -> int:
        return int(r.info("stats")[field])

    try:
        vs = versions(201)
        keys_checked = checked(a)
        m = save_whole(a, vs[0])
        b.get("ns", "s")
        sent, read, asked = [], [], []
        for prev, v in itertools.pairwise(vs):
            before, n_checks = net("total_net_input_bytes"), len(keys_checked)
            m = append(a, v, prev.n, m.generation)
            sent.append(net("total_net_input_bytes") - before)
            asked.append(sum(keys_checked[n_checks:]))
            before = net("total_net_output_bytes")
            assert b.get("ns", "s").generation == m.generation
            read.append(net("total_net_output_bytes") - before)
        assert b.get("ns", "s").encode() == m.encode()
        early, late = slice(9, 29), slice(179, 199)  # turns 10..29 and 180..199
        # a turn that is appended sends the same bytes at turn 200 as at turn 10 (2 chunks, a record)
        assert statistics.median(sent[late]) <= 1.05 * statistics.median(sent[early])
        # compactions included (a whole manifest, paid for by the turns since the last one): amortized
        assert statistics.mean(sent[late]) <= 1.5 * statistics.mean(sent[early])
        # the reader catching up reads the turn after its version, not the session
        assert statistics.median(read[late]) <= 1.05 * statistics.median(read[early])
        assert statistics.mean(read[late]) <= 2.0 * statistics.mean(read[early])
        # no chunk of an earlier version is looked up: at most the turn's own
        assert max(asked) <= PER
        # besides the turn's chunks, an append sends its turn record: a fraction of the manifest it extends
        chunks = PER * len(vs[0].full.blobs[0])
        base = len(m.encode())
        assert statistics.median(sent[late]) - chunks < base / 3
    finally:
        a.close()
        b.close()


def test_the_turns_of_a_tenant_share_its_slot() -> None:
    keys = RedisKeys("p", tagged=True)
    slots = {_slot(k) for k in (keys.generations("t"), keys.record("t", "s"), keys.turns("t", "s"), keys.changes("t"),
                       keys.turns("t", "other"))}
    assert len(slots) == 1


def _slot(key: bytes) -> bytes:
    """The hash tag Redis Cluster hashes ``key`` by (the text between its first ``{`` and the next ``}``)."""
    start = key.index(b"{")
    return key[start + 1 : key.index(b"}", start)]



def test_an_independent_reader_of_format_md_decodes_the_shared_session(
        two: tuple[SessionStore, SessionStore, str], redis_url: str) -> None:
    """docs/format_example.py's ``read_shared_session`` (FORMAT.md alone, no kvstore import) reads the raw
    Redis keys as the daemons do: the base, then every turn, whether the list is long or just compacted."""
    spec = importlib.util.spec_from_file_location("format_example", ROOT_DIR / "docs" / "format_example.py")
    assert spec is not None and spec.loader is not None
    fx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fx)
    a, _, prefix = two
    r = redis.Redis.from_url(redis_url)
    vs = versions(12)
    m = save_whole(a, vs[0])
    applied = set()
    for prev, v in itertools.pairwise(vs):
        m = append(a, v, prev.n, m.generation)
        got = fx.read_shared_session(r, prefix, "ns", "s")
        assert got["chunk_keys"] == [k.hex() for k in m.chunk_keys]
        assert (got["token_count"], got["tail"], got["last_token_ids"], got["generation"], got["updated_at"]) == \
            (m.token_count, m.tail, list(m.last_token_ids), m.generation, m.updated_at)
        assert got["turn_records"] == list_len(redis_url, prefix)
        applied.add(got["turn_records"])
    assert 0 in applied and max(applied) >= 1  # read right after a compaction, and through turns
    a.delete("ns", "s")
    assert fx.read_shared_session(r, prefix, "ns", "s") is None
