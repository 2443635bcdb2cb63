"""An independent reader reads a session a real daemon wrote turn by turn: docs/format_example.py's
``read_session`` / ``read_chunk`` (FORMAT.md alone, no kvstore import) and tests/node/read_chunk.js's
``session`` (the values of the manifest and its turn records, in key order) read the LMDB data
directory, while the session is a base plus turn records (several appends, no compaction yet) and
after a compaction, and each must read what kvstore's client loads."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import lmdb
import pytest

from kvstore.client import Client
from kvstore.format.manifest import Manifest
from kvstore.server.process import DaemonProcess
from tests.helpers.store import CHUNK_TOKENS, Session, build_session, preset_definitions, token_stream

ROOT_DIR = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT_DIR / "docs" / "format_example.py"
READER = ROOT_DIR / "tests" / "node" / "read_chunk.js"
PER = 2  # chunks a turn
NS, SID = "ns", "chat"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("format_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fx = example()


def grown(turns: int) -> list[Session]:
    ids = token_stream(5, turns * PER * CHUNK_TOKENS + 3)
    return [build_session(NS, SID, ids[: (t + 1) * PER * CHUNK_TOKENS + 3]) for t in range(turns)]


def save_turns(address: str, versions: list[Session], done: int) -> Manifest:
    """Save ``versions[done:]`` turn by turn (the first, if done is 0, whole; then appends)."""
    with Client(address) as c:
        for i in range(done, len(versions)):
            n = len(versions[i].keys) - (len(versions[i - 1].keys) if i else 0)
            if i:  # the client appends to the version it saved or loaded last
                c.get_session(NS, SID)
            c.save_session(versions[i].manifest(), list(versions[i].blobs[-n:]))
        return c.get_session(NS, SID)[0]


def loaded(address: str) -> tuple[Manifest, dict[int, bytes]]:
    with Client(address) as c:
        m, pairs = c.load_session(NS, SID)
        return m, {i: bytes(b) for i, b in pairs}


def raw_values(data_dir: Path) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The manifest's value and the session's turn records (key, value) in key order, read with lmdb."""
    with lmdb.open(str(data_dir / "ssd"), readonly=True, max_dbs=8) as env, env.begin() as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        base = txn.get(f"m:{NS}/{SID}".encode(), db=meta)
        prefix = f"t:{NS}/{SID}".encode() + b"\0"
        cur = txn.cursor(db=meta)
        recs = []
        if cur.set_range(prefix):
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                recs.append((bytes(k), bytes(v)))
    assert base is not None
    return bytes(base), recs


def check_python_reader(data_dir: Path, want: Manifest, chunks: dict[int, bytes], records: int) -> None:
    got = fx.read_session(data_dir, NS, SID)
    assert got is not None
    assert got["turn_records"] == records
    assert (got["chunk_keys"], got["token_count"], got["tail"], got["last_token_ids"], got["generation"],
            got["updated_at"], got["created_at"], got["chunk_tokens"], got["layout_id"]) == \
        ([k.hex() for k in want.chunk_keys], want.token_count, want.tail, list(want.last_token_ids),
         want.generation, want.updated_at, want.created_at, want.chunk_tokens, want.layout_id.hex())
    assert fx.chunk_token_ids(got["tail"]) == list(want.last_token_ids[-(want.token_count % CHUNK_TOKENS):])
    assert {i: fx.read_chunk(data_dir, bytes.fromhex(k)) for i, k in enumerate(got["chunk_keys"])} == chunks


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The presets' definitions, as FORMAT.md section 1 lists them (what the hashed JSON holds, plus the name)."""
    return preset_definitions(tmp_path_factory.mktemp("layouts") / "layouts.json")


def node() -> str | None:
    found = shutil.which("node")
    if found is None and os.environ.get("KVSTORE_REQUIRE_NODE") == "1":
        pytest.fail("KVSTORE_REQUIRE_NODE=1 but node is not on PATH")
    return found


def check_node_reader(data_dir: Path, layouts: Path, tmp: Path, want: Manifest, records: int) -> None:
    js = node()
    if js is None:
        return
    base, recs = raw_values(data_dir)
    assert len(recs) == records
    files = [tmp / "m.bin"] + [tmp / f"t{i}.bin" for i in range(len(recs))]
    for f, blob in zip(files, [base, *(v for _, v in recs)]):
        f.write_bytes(blob)
    done = subprocess.run([js, str(READER), "session", str(layouts), *map(str, files)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["turn_records"] == records
    meta = got["meta"]
    assert (meta["chunk_keys"], meta["token_count"], meta["last_token_ids"], meta["generation"], meta["updated_at"],
            meta["created_at"]) == ([k.hex() for k in want.chunk_keys], want.token_count, list(want.last_token_ids),
                                    want.generation, want.updated_at, want.created_at)
    assert got["tail_len"] == len(want.tail)
    assert got["tail"]["token_ids"] == list(want.last_token_ids[-(want.token_count % CHUNK_TOKENS):])
    assert got["tail"]["header"]["start"] == len(want.chunk_keys) * CHUNK_TOKENS


def test_a_session_of_turn_records_and_then_compacted_reads_whole(layouts: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    versions = grown(5)
    args = ["--store-chunk-tokens", str(CHUNK_TOKENS)]
    d = DaemonProcess(data_dir, args).start()  # compact_turn_keys 256: no compaction for these turns
    try:
        saved = save_turns(d.address, versions[:4], 0)
        want, chunks = loaded(d.address)
        assert want.chunk_keys == saved.chunk_keys == versions[3].keys
        base, recs = raw_values(data_dir)  # read beside the running daemon
        assert len(recs) == 3 and [k[-4:] for k, _ in recs] == [i.to_bytes(4, "big") for i in range(3)]
        assert len(fx.read_manifest(base)["chunk_keys"]) == PER  # the base alone is the first version
        check_python_reader(data_dir, want, chunks, records=3)
        check_node_reader(data_dir, layouts, tmp_path, want, records=3)
    finally:
        d.stop()
    # compact_turn_keys 1: the records on disk already name more keys than the base, so the next turn
    # writes the manifest whole and deletes them
    d = DaemonProcess(data_dir, [*args, "--store-compact-turn-keys", "1"]).start()
    try:
        saved = save_turns(d.address, versions, 4)
        want, chunks = loaded(d.address)
        assert want.chunk_keys == saved.chunk_keys == versions[4].keys
        base, recs = raw_values(data_dir)
        assert recs == [] and len(fx.read_manifest(base)["chunk_keys"]) == len(versions[4].keys)
        check_python_reader(data_dir, want, chunks, records=0)
        check_node_reader(data_dir, layouts, tmp_path, want, records=0)
    finally:
        d.stop()


def record_flags(data_dir: Path) -> set[int]:
    with lmdb.open(str(data_dir / "ssd"), readonly=True, max_dbs=8) as env, env.begin() as txn:
        return {bytes(v)[0] for _, v in txn.cursor(db=env.open_db(b"chunks", txn=txn, create=False))}


def test_compact_chunk_records_read_whole(tmp_path: Path) -> None:
    """A daemon with ``--ssd-compact-records`` keeps every chunk as a flag 2 record (the codes' sign plane and
    magnitude stream, the transformed tail): the independent reader rebuilds each chunk, byte for byte what
    kvstore's client loads."""
    data_dir = tmp_path / "data"
    d = DaemonProcess(data_dir, ["--store-chunk-tokens", str(CHUNK_TOKENS), "--ssd-compact-records"]).start()
    try:
        save_turns(d.address, grown(2), 0)
        want, chunks = loaded(d.address)
        assert record_flags(data_dir) == {2}
        check_python_reader(data_dir, want, chunks, records=1)
    finally:
        d.stop()


def test_the_reader_imports_nothing_of_kvstore(tmp_path: Path) -> None:
    """format_example's reader is independent: reading a session (turn records and all) loads no kvstore module."""
    fx.turn_example(tmp_path)
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('fx', {str(EXAMPLE)!r}); "
            "fx = importlib.util.module_from_spec(spec); spec.loader.exec_module(fx); "
            f"s = fx.read_session({str(tmp_path)!r}, 'demo', 'chat'); "
            "assert s['turn_records'] == 2 and s['token_count'] == 7, s; "
            "bad = sorted(m for m in sys.modules if m == 'kvstore' or m.startswith('kvstore.')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
