"""Page layouts a tenant registers cannot break the daemon or lose data (issue 27, items 3, 4, 5, 7).

A definition is checked in canonical form and in the units the daemon computes with before it is
stored; a stored one always reopens, and one that does not (damage) never costs data; Stats and
/metrics survive any layout a tenant may register; each namespace holds its own, bounded, set.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_helpers import free_port, start_daemon, status_of

from kvstore.client import Client
from kvstore.engines.vllm.geometry import page_layout, v41_groups
from kvstore.format import page
from kvstore.format.manifest import Manifest
from kvstore.format.page_layout import MAX_DEFINITION_BYTES, MAX_TOKENS, PageLayout, PageLayoutError

V41 = page_layout("deepseek-ai/DeepSeek-V4.1-Flash", "nvfp4_ds_mla", "mxfp4", v41_groups(), 136704, 1,
                  {"tp_size": "1"})


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
    return Manifest(sid, ns, lay.layout_id, tokens, 0, tuple(keys), b"", ())


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
