"""A session's kind, token chain or engine pages, is chosen once from its layout and said by its
manifest (issue 28, point 4): a manifest of another kind than its layout's is refused, a stored one
names its kind, and a page session stored before manifests said their kind (``chunk_tokens`` 0, as
the daemon wrote them then) still reads, loads, grows and counts as engine pages after a restart."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.format import page
from kvstore.format.keys import ROOT
from kvstore.format.manifest import Kind, Manifest, ManifestError, Retention
from kvstore.format.page_layout import PageLayout
from kvstore.store import SessionStore, bytes_per_token, open_store
from tests.helpers.pages import opaque_layout
from tests.helpers.store import TINY8, build_session, save, store_config, token_stream

NS = "team-a"
LAYOUT = opaque_layout("kinds", block_bytes=256)


def blocks(n: int, first: int = 0, lay: PageLayout = LAYOUT) -> tuple[list[bytes], list[bytes]]:
    """``n`` blocks of every group of ``lay``: their keys and page blobs."""
    keys, blobs = [], []
    for i in range(first, first + n):
        h = (i + 1).to_bytes(32, "little")
        for g in lay.groups:
            key = page.page_key(lay.layout_id, NS, g.group, h)
            keys.append(key)
            blobs.append(page.encode(lay, g.group, h, key, bytes([i % 256]) * g.block_bytes))
    return keys, blobs


def pages_manifest(sid: str, keys: list[bytes], tokens: int) -> Manifest:
    return Manifest(sid, NS, LAYOUT.layout_id, tokens, 0, tuple(keys), b"", (), retention=Retention(ttl_s=3600),
                    kind=Kind.ENGINE_PAGES)


def as_stored_before_kinds(m: Manifest) -> bytes:
    """``m`` as a daemon wrote it before manifests said their kind: docs/FORMAT.md section 3, its meta
    keys in the order that writer wrote them, and no ``kind``."""
    meta = {"session_id": m.session_id, "namespace": m.namespace, "layout_id": m.layout_id.hex(),
            "token_count": m.token_count, "chunk_tokens": m.chunk_tokens, "chunk_keys": [k.hex() for k in m.chunk_keys],
            "last_token_ids": list(m.last_token_ids), "created_at": m.created_at, "updated_at": m.updated_at,
            "retention": {"pinned": m.retention.pinned, "ttl_s": m.retention.ttl_s}, "metadata": m.metadata,
            "generation": m.generation}
    mj = json.dumps(meta, separators=(",", ":")).encode()
    body = struct.pack("<4sHI", b"KVMF", 1, len(mj)) + mj + struct.pack("<I", len(m.tail)) + m.tail
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def stored_meta(ss: SessionStore, m: Manifest) -> dict[str, object]:
    blob = ss.store.get_meta(m.key)
    assert blob is not None
    (mlen,) = struct.unpack_from("<I", blob, 6)
    return json.loads(bytes(blob[10 : 10 + mlen]))  # type: ignore[no-any-return]


@pytest.fixture
def ss(tmp_path: Path) -> Iterator[SessionStore]:
    s = open_store(store_config(tmp_path))
    s.layouts.register(LAYOUT.definition(), [NS])
    yield s
    s.close()


def test_a_manifest_is_of_the_kind_its_layout_says(ss: SessionStore) -> None:
    assert ss.kinds.for_layout(NS, LAYOUT.layout_id).kind is Kind.ENGINE_PAGES
    assert ss.kinds.for_layout(NS, TINY8.layout_id).kind is Kind.TOKEN_CHAIN
    with pytest.raises(InvalidArgument, match="unknown layout id"):  # another namespace's: as no one's
        ss.kinds.for_layout("team-b", LAYOUT.layout_id)

    chain = build_session(NS, "chain", token_stream(1, 100))
    assert save(ss, chain).kind is Kind.TOKEN_CHAIN
    assert ss.get(NS, "chain").kind is Kind.TOKEN_CHAIN
    assert "kind" not in stored_meta(ss, chain.manifest())  # a token chain's manifest is what it was
    assert ss.store.get_meta(chain.manifest().key) == as_stored_before_kinds(ss.get(NS, "chain"))

    keys, blobs = blocks(3)
    m, _ = ss.save_session(NS, LAYOUT.layout_id, ROOT, 0, blobs, pages_manifest("pages", keys, 768))
    assert m.kind is Kind.ENGINE_PAGES and ss.get(NS, "pages").kind is Kind.ENGINE_PAGES
    assert stored_meta(ss, m)["kind"] == "engine-pages"

    # a manifest of another kind than its layout's is refused, and nothing of it is stored
    chain_of_pages = Manifest("wrong", NS, LAYOUT.layout_id, 2 * 16, 16, tuple(keys[:2]), b"", ())
    with pytest.raises(InvalidArgument, match="engine pages"):
        ss.commit(chain_of_pages)
    pages_of_tiny = Manifest("wrong", NS, TINY8.layout_id, 0, 0, chain.keys[:1], b"", (), kind=Kind.ENGINE_PAGES)
    with pytest.raises(InvalidArgument, match="0-token chunks"):
        ss.commit(pages_of_tiny)
    with pytest.raises(InvalidArgument, match="looked up by key"):
        ss.lookup(NS, LAYOUT.layout_id, list(range(256)))
    assert [s.session_id for s in ss.list_sessions(NS)] == ["chain", "pages"]


def test_a_manifest_names_a_kind_it_is() -> None:
    """What a manifest's kind allows is checked where it is built, and where it is read back."""
    with pytest.raises(InvalidArgument, match="engine pages"):
        Manifest("s", NS, LAYOUT.layout_id, 256, 16, (), b"", (), kind=Kind.ENGINE_PAGES)
    with pytest.raises(InvalidArgument, match="token chain"):
        Manifest("s", NS, TINY8.layout_id, 256, 0, (), b"", ())
    good = pages_manifest("s", blocks(1)[0], 256)
    for change, damage in ((b'"kind":"engine-pages"', b'"kind":"engine-cages"'),
                           (b'"chunk_tokens":0', b'"chunk_tokens":8')):
        blob = good.encode()
        assert change in blob
        body = blob[:-8].replace(change, damage)
        with pytest.raises(ManifestError):
            Manifest.decode(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
    assert Manifest.decode(good.encode()) == good


def test_a_page_manifest_stored_before_kinds_reads_as_engine_pages_after_a_restart(tmp_path: Path) -> None:
    cfg = store_config(tmp_path)
    ss = open_store(cfg)
    ss.layouts.register(LAYOUT.definition(), [NS])
    keys, blobs = blocks(3)
    m, _ = ss.save_session(NS, LAYOUT.layout_id, ROOT, 0, blobs, pages_manifest("old", keys, 768))
    old = as_stored_before_kinds(m)
    assert b'"kind"' not in old and b'"chunk_tokens":0' in old
    ss.store.put_meta(m.key, old)  # as the daemon wrote it then
    ss.close()

    ss = open_store(cfg)  # the restart: every chunk it names is still owned, so none is collected
    try:
        back = ss.get(NS, "old")
        assert back.kind is Kind.ENGINE_PAGES and back == m
        assert ss.lookup_keys(NS, keys) == ["ssd"] * len(keys)
        with ss.read(NS, keys) as got:  # verified as page blobs
            assert [bytes(b) for b in got if b is not None] == blobs
        assert bytes_per_token(ss).tokens == 768
        more_keys, more = blocks(1, first=3)  # the session grows by a turn, as engine pages
        grown, _ = ss.save_session(NS, LAYOUT.layout_id, ROOT, 0, more,
                                   pages_manifest("old", [*keys, *more_keys], 1024))
        assert grown.kind is Kind.ENGINE_PAGES and stored_meta(ss, grown)["kind"] == "engine-pages"
        with ss.read(NS, grown.chunk_keys) as got:
            assert [bytes(b) for b in got if b is not None] == [*blobs, *more]
    finally:
        ss.close()
