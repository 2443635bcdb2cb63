"""Page layouts a tenant registers cannot break the daemon or lose data (issue 27, items 3, 4, 5, 7).

A definition is checked in canonical form and in the units the daemon computes with before it is
stored; a stored one always reopens, and one that does not (damage) never costs data; Stats and
/metrics survive any layout a tenant may register; each namespace holds its own, bounded, set.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest
from kvstore.format.page_layout import MAX_DEFINITION_BYTES, MAX_TOKENS, PageLayout, PageLayoutError
from kvstore.store.sessions.layouts import Layouts
from kvstore.tiers.base import WriteBatch
from kvstore.tiers.config import SsdTierConfig
from kvstore.tiers.ssd.tier import SsdTier
from tests.helpers.daemon import REPO, Daemon, clean_env, free_port, kvstore_command, start_daemon, status_of
from tests.helpers.pages import v41_layout
from tests.helpers.store import make_tiered, store_config

V41 = v41_layout("nvfp4_ds_mla", {"tp_size": "1"})  # the geometry module no longer has a V4.1 table


def edited(change: Callable[[dict[str, Any]], None], layout: PageLayout = V41) -> bytes:
    d = json.loads(layout.definition())
    change(d)
    return json.dumps(d).encode()


def tiny(name: str = "m", tokens: int = 16, states: int = 4, data: int = 8, groups: int = 1) -> bytes:
    """A small valid definition, its ints where a test wants them."""
    return json.dumps({"kind": "engine-pages", "name": name, "engine": "e", "fingerprint": {}, "groups": [
        {"group": g, "tokens": tokens, "block_bytes": states * data,
         "pages": [{"name": "p", "offset": 0, "states": states, "data": data, "scale": 0, "arrangement": "split",
                    "page_bytes": states * data}]} for g in range(groups)]}, ensure_ascii=False).encode()


def setter(path: tuple[str | int, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        at: Any = d
        for p in path[:-1]:
            at = at[p]
        at[path[-1]] = value
    return change


# -- definitions: refused before anything exists, naming the field -------------------------------------
BAD: list[tuple[bytes, str]] = [
    (V41.definition().replace(b'"tokens":256', b'"tokens":Infinity', 1), "Infinity"),
    (V41.definition().replace(b'"tokens":256', b'"tokens":-Infinity', 1), "-Infinity"),
    (V41.definition().replace(b'"tokens":256', b'"tokens":NaN', 1), "NaN"),
    (V41.definition().replace(b'"tokens":256', b'"tokens":1e400', 1), "1e400"),
    (V41.definition().replace(b'"tokens":256', b'"tokens":256.0', 1), "groups[0].tokens"),
    (V41.definition().replace(b'"tokens":256', b'"tokens":"256"', 1), "groups[0].tokens"),
    (V41.definition().replace(b'"tokens":256', b'"tokens":true', 1), "groups[0].tokens"),
    (edited(setter(("groups", 0, "tokens"), 10**30)), "groups[0].tokens"),
    (edited(setter(("groups", 0, "pages", 0, "states"), 10**300)), "groups[0].pages[0].states"),
    (edited(setter(("groups", 0, "pages", 0, "data"), 1 << 40)), "groups[0].pages[0].data"),
    (edited(setter(("groups", 0, "block_bytes"), 1 << 33)), "groups[0].block_bytes"),
    (edited(setter(("groups", 0, "group"), -1)), "groups[0].group"),
    (edited(setter(("groups", 0, "group"), 1 << 32)), "groups[0].group"),
    (edited(setter(("groups", 0, "pages", 0, "name"), ["x"])), "groups[0].pages[0].name"),
    (edited(setter(("name",), 7)), "name"),
    (tiny().replace(b'"name": "m"', b'"name": "\\ud800"'), "UTF-8"),
    (b"[" * 30000 + b"]" * 30000, "nests"),
    (b'{"kind":"engine-pages","x":' + b"[" * 20000 + b"]" * 20000 + b"}", "nests"),
    (tiny(name="\u00e9" * 12000), "canonical"),  # 24 KB as sent, 72 KB escaped as \u00e9
]


@pytest.mark.parametrize("definition,names", BAD, ids=[n for _, n in BAD])
def test_a_definition_is_checked_in_canonical_form_and_in_the_daemons_units(definition: bytes, names: str) -> None:
    assert len(definition) <= MAX_DEFINITION_BYTES
    with pytest.raises(PageLayoutError, match=names.replace("[", r"\[").replace(".", r"\.")):
        PageLayout.from_definition(definition)


def test_a_valid_definition_reads_back_as_itself_and_vllms_layouts_still_register() -> None:
    for lay in (V41, PageLayout.from_definition(tiny(name="\u00e9" * 5000))):
        again = PageLayout.from_definition(lay.definition())
        assert again == lay and again.definition() == lay.definition() and again.layout_id == lay.layout_id
        assert float(lay.bytes_per_token) < float("inf")


def test_register_layout_answers_invalid_argument_naming_the_field_and_stores_nothing(tmp_path: Path) -> None:
    """Before: INTERNAL (OverflowError, RecursionError), or a layout stored that then broke Stats."""
    d = start_daemon(tmp_path / "data", "--port", str(free_port()))
    try:
        with Client(address=d.address) as c:
            for definition, names in BAD:
                code, msg = status_of(lambda: c.register_layout(definition))  # noqa: B023 (called at once)
                assert code is grpc.StatusCode.INVALID_ARGUMENT, (names, code, msg)
                assert names in msg, (names, msg)
            assert c.register_layout(V41.definition()) == V41.layout_id
            c.stats()
    finally:
        d.stop()


# -- Stats and /metrics survive any layout a tenant may register -----------------------------------------
def extreme() -> PageLayout:
    """Valid at every bound: a group of 2^24 tokens per block beside one of 1 token, the largest
    group index; its bytes per token and per-blob token shares make the store's sums lopsided
    (more payload than stored bytes: an overhead below zero)."""
    return PageLayout.from_definition(json.dumps({
        "kind": "engine-pages", "name": "extreme", "engine": "e", "fingerprint": {}, "groups": [
            {"group": g, "tokens": t, "block_bytes": 16, "pages": [{"name": "p", "offset": 0, "states": 1, "data": 16,
                                                                   "scale": 0, "arrangement": "split",
                                                                   "page_bytes": 16}]}
            for g, t in ((0, MAX_TOKENS), ((1 << 32) - 1, 1))]}).encode())


def page_blobs(lay: PageLayout, ns: str, n: int) -> tuple[list[bytes], list[bytes]]:
    keys, blobs = [], []
    for i in range(n):
        for g in lay.groups:
            h = (i + 1).to_bytes(32, "little")
            key = page.page_key(lay.layout_id, ns, g.group, h)
            keys.append(key)
            blobs.append(page.encode(lay, g.group, h, key, bytes([i % 256]) * g.block_bytes))
    return keys, blobs


def page_manifest(lay: PageLayout, ns: str, sid: str, keys: list[bytes], tokens: int) -> Manifest:
    return Manifest(sid, ns, lay.layout_id, tokens, 0, tuple(keys), b"", (), kind=Kind.ENGINE_PAGES)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return str(r.read().decode())


def test_stats_and_metrics_answer_for_every_tenant_whatever_layouts_sessions_are_under(tmp_path: Path) -> None:
    """Before: a layout of 10^30 tokens per block, or one whose bytes per token overflow a double,
    was stored and then Stats answered INTERNAL and /metrics 500 for everyone; a valid but lopsided
    layout still does (a negative overhead in a u64 field)."""
    mport = free_port()
    d = start_daemon(tmp_path / "data", "--port", str(free_port()), "--metrics-port", str(mport))
    try:
        lay = extreme()
        with Client(address=d.address) as c:
            assert c.register_layout(lay.definition()) == lay.layout_id
            keys, blobs = page_blobs(lay, "team-a", 64)
            c.save_session(page_manifest(lay, "team-a", "s1", keys, (1 << 64) - 1), blobs)
            c.save_session(page_manifest(lay, "team-a", "s2", keys[:2], (1 << 64) - 1), [])
            b = c.stats().bytes_per_token
            assert b.sessions == 2 and b.unique_chunks == 128 and b.tokens > 0 and b.chunk_overhead == 0
            assert b.formula == pytest.approx(float(lay.bytes_per_token))
        assert "kvstore_sessions 2.0" in metrics_text(mport)
    finally:
        d.stop()


# -- a stored layout that does not reopen never costs data -----------------------------------------------
def v41_blobs(ns: str, n: int = 3) -> tuple[list[bytes], list[bytes]]:
    keys, blobs = [], []
    for i in range(n):
        for g in V41.groups:
            h = (i + 1).to_bytes(32, "little")
            key = page.page_key(V41.layout_id, ns, g.group, h)
            keys.append(key)
            rng = np.random.default_rng((i, g.group))
            blobs.append(page.encode(V41, g.group, h, key, rng.integers(0, 256, g.block_bytes, dtype=np.uint8)))
    return keys, blobs


def damage_meta(data: Path, key: bytes, value: bytes) -> None:
    """Overwrite one record of the stopped daemon's meta keyspace (what a damaged disk could leave)."""
    with SsdTier(SsdTierConfig(path=str(data / "ssd"))) as tier:
        tier.meta().put(key, value)


def held_by_ssd(data: Path, keys: list[bytes]) -> list[bool]:
    with SsdTier(SsdTierConfig(path=str(data / "ssd"))) as tier:
        return tier.contains_many(keys)


def layouts_health(d: Daemon) -> tuple[str, int, str]:
    """kvstore.layouts' status, and what `kvstore health` exits with and prints."""
    with grpc.insecure_channel(d.address) as channel:
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvstore.layouts"),
                                                       timeout=10)
    cli = subprocess.run([*kvstore_command(), "health", "--address", d.address], cwd=REPO, env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status), cli.returncode, cli.stdout


def test_a_layout_that_does_not_reopen_keeps_its_data_says_so_and_comes_back_registered_again(tmp_path: Path) -> None:
    """Before: the next load returned none of its blobs and deleted them from the ssd tier, and
    Stats failed. Now its blobs are misses no tier is asked for, nothing is deleted, the log, Stats
    and /metrics say so, and registering the definition again serves them again."""
    data, port, mport = tmp_path / "data", free_port(), free_port()
    flags = ("--port", str(port), "--metrics-port", str(mport))
    keys, blobs = v41_blobs("team-a")
    d = start_daemon(data, *flags)
    try:
        with Client(address=d.address) as c:
            c.register_layout(V41.definition(), "team-a")
            c.save_session(page_manifest(V41, "team-a", "s1", keys, 768), blobs)
    finally:
        assert d.stop() == 0
    damage_meta(data, b"L:" + V41.layout_id, V41.definition()[:-1])  # a torn write: no closing brace
    d = start_daemon(data, *flags)
    try:
        with Client(address=d.address) as c:
            status, rc, out = layouts_health(d)
            assert (status, rc) == ("NOT_SERVING", 1) and "kvstore.layouts NOT_SERVING" in out, out
            assert list(c.load_chunks("team-a", keys)) == []  # misses...
            assert c.lookup_keys("team-a", keys) == [None] * len(keys)
            s = c.stats()  # ...that Stats reports, for every tenant's sake
            ssd = next(t for t in s.tiers if t.name == "ssd")
            assert ssd.errors >= 1 and V41.layout_hex in ssd.last_error and "data is kept" in ssd.last_error
            assert (s.bytes_per_token.sessions, s.bytes_per_token.unique_chunks) == (1, len(keys))
            assert "kvstore_tier_errors_total" in metrics_text(mport)
            code, msg = status_of(lambda: c.save_session(page_manifest(V41, "team-a", "s2", keys, 768), blobs))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "unknown layout id" in msg
    finally:
        assert d.stop() == 0
    assert all(held_by_ssd(data, keys))  # ...and never deleted
    log = data.with_name(data.name + ".log").read_text()
    assert log.count(f"page layout {V41.layout_hex} did not reopen") == 1
    d = start_daemon(data, *flags)
    try:
        with Client(address=d.address) as c:
            assert c.register_layout(V41.definition(), "team-a") == V41.layout_id  # written again, whole
            assert [bytes(b) for _, b in c.load_chunks("team-a", keys)] == blobs
    finally:
        d.stop()
    d = start_daemon(data, *flags)  # and it reopens
    try:
        with Client(address=d.address) as c:
            assert [bytes(b) for _, b in c.load_chunks("team-a", keys)] == blobs
            assert not any(V41.layout_hex in t.last_error for t in c.stats().tiers)
        assert layouts_health(d) == ("SERVING", 0, "SERVING\n")
    finally:
        d.stop()


# -- page layouts per namespace ------------------------------------------------------------------------
TOKENS = '[tokens]\n"tok-a" = ["team-a"]\n"tok-b" = ["team-b"]\n"tok-admin" = ["*"]\n'


def small(name: str) -> PageLayout:
    return PageLayout.from_definition(tiny(name=name))


def answer(fn: Callable[[], object], lay: PageLayout) -> tuple[grpc.StatusCode, str]:
    code, msg = status_of(fn)
    return code, msg.replace(lay.layout_hex, "<id>")


def test_each_namespace_holds_its_own_bounded_set_of_layouts_across_restarts(tmp_path: Path) -> None:
    """Before: one store-wide table of 1,024 that one tenant could fill for everyone, and a full
    table that told whether a definition already existed. Now a quota per namespace; a full one
    answers RESOURCE_EXHAUSTED alike for a definition another namespace holds and one nobody does;
    only a layout's holders (or everyone, for an admin's) may save under it."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS)
    data, port = tmp_path / "data", free_port()
    flags = ("--port", str(port), "--tokens-file", str(tokens), "--store-max-layouts-per-namespace", "3")
    a_lays = [small(f"a{i}") for i in range(4)]
    d = start_daemon(data, *flags)
    try:
        with Client(address=d.address, token="tok-a") as a, Client(address=d.address, token="tok-b") as b, \
                Client(address=d.address, token="tok-admin") as admin:
            for lay in a_lays[:3]:
                assert a.register_layout(lay.definition()) == lay.layout_id  # no namespace: the token's one
            code, msg = status_of(lambda: a.register_layout(a_lays[3].definition()))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "team-a" in msg and "3" in msg
            assert a.register_layout(a_lays[0].definition(), "team-a") == a_lays[0].layout_id  # its own: full or not
            code, _ = status_of(lambda: a.register_layout(a_lays[3].definition(), "team-b"))
            assert code is grpc.StatusCode.PERMISSION_DENIED
            # another namespace's layout is an unknown id to B, as one nobody registered
            keys, blobs = page_blobs(a_lays[1], "team-b", 1)
            theirs = answer(lambda: b.save_session(page_manifest(a_lays[1], "team-b", "s", keys, 16), blobs),
                            a_lays[1])
            keys, blobs = page_blobs(a_lays[3], "team-b", 1)
            nobodys = answer(lambda: b.save_session(page_manifest(a_lays[3], "team-b", "s", keys, 16), blobs),
                             a_lays[3])
            assert theirs == nobodys and theirs[0] is grpc.StatusCode.INVALID_ARGUMENT
            # the same definition: the same id, held by each that registered it
            assert b.register_layout(a_lays[1].definition()) == a_lays[1].layout_id
            keys, blobs = page_blobs(a_lays[1], "team-b", 1)
            b.save_session(page_manifest(a_lays[1], "team-b", "s", keys, 16), blobs)
            b.register_layout(small("b1").definition())
            b.register_layout(small("b2").definition())
            # B is full: A's definition and a fresh one get one answer
            held_by_a = answer(lambda: b.register_layout(a_lays[2].definition()), a_lays[2])
            fresh = answer(lambda: b.register_layout(small("fresh").definition()), small("fresh"))
            assert held_by_a == fresh and held_by_a[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
            # an admin's registration is global: every namespace may save under it
            shared = small("shared")
            assert admin.register_layout(shared.definition()) == shared.layout_id
            keys, blobs = page_blobs(shared, "team-b", 1)
            b.save_session(page_manifest(shared, "team-b", "s2", keys, 16), blobs)
    finally:
        assert d.stop() == 0
    d = start_daemon(data, *flags)  # holders and quotas are kept
    try:
        with Client(address=d.address, token="tok-a") as a, Client(address=d.address, token="tok-b") as b:
            assert a.register_layout(a_lays[2].definition()) == a_lays[2].layout_id
            code, _ = status_of(lambda: a.register_layout(a_lays[3].definition()))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            keys, blobs = page_blobs(a_lays[2], "team-a", 2)
            a.save_session(page_manifest(a_lays[2], "team-a", "s", keys, 32), blobs)
            assert [bytes(x) for _, x in a.load_chunks("team-a", keys)] == blobs
            keys, blobs = page_blobs(a_lays[2], "team-b", 1)
            code, msg = status_of(lambda: b.save_session(page_manifest(a_lays[2], "team-b", "s3", keys, 16), blobs))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "unknown layout id" in msg
            keys, blobs = page_blobs(small("shared"), "team-b", 1)
            assert [bytes(x) for _, x in b.load_chunks("team-b", keys)] == blobs
    finally:
        d.stop()


def test_a_layout_stored_before_holders_were_kept_reopens_global_and_a_held_one_stays_its_holders(
        tmp_path: Path) -> None:
    """Upgrading changes no one's access: a definition with no holder record was global, and stays so."""
    old, held = small("old"), small("held")
    store = make_tiered(store_config(tmp_path))
    try:
        store.put_meta(b"L:" + old.layout_id, old.definition())
        Layouts(store, 64).register(held.definition(), ["team-a"])
        again = Layouts(store, 64)
        assert again.usable("team-b", old.layout_id) == old and again.usable("team-a", old.layout_id) == old
        assert again.usable("team-a", held.layout_id) == held and again.usable("team-b", held.layout_id) is None
        assert again.page(held.layout_id) == held and not again.unreadable
        store.commit(WriteBatch(meta_deletes=[b"L:" + held.layout_id]))  # holders left, the definition gone
        lost = Layouts(store, 64)
        assert lost.unreadable == {held.layout_id: "its definition is missing"} and lost.page(held.layout_id) is None
        assert lost.register(held.definition(), ["team-b"]) == held  # anyone's registration writes it again
        back = Layouts(store, 64)
        assert back.usable("team-a", held.layout_id) == held and back.usable("team-b", held.layout_id) == held
        assert not back.unreadable
    finally:
        store.close()
