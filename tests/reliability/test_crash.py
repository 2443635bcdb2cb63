"""Crash safety: real writer processes SIGKILLed mid-save, then the store is opened again.

A writer process opens the store and saves sessions in a loop (save_chunks, then commit), printing
``committed <session> <version>`` after each acknowledged commit. The test kills it with SIGKILL
at varied points: right after a commit, while save_chunks is writing, between save_chunks and
commit, or after a random delay. After each kill the store must open, hold every acknowledged
session at that version or later with every chunk intact, never hold or serve a torn chunk, and
have collected the interrupted save's chunks. All writers share one store directory, so every
kill lands on the wreckage of the previous ones.

Writers are forked from one helper process (started with ``python -c``) that has imported
torch and kvstore once: each writer is still its own process with its own LMDB environment, but
the ten of them do not pay ten interpreter starts and torch imports.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import NotFound
from kvstore.format import chunk
from kvstore.format.keys import ROOT
from kvstore.format.manifest import KEY_PREFIX, Manifest
from kvstore.store import SessionStore, StoreConfig, open_store
from kvstore.tiers.ssd.tier import DB_NAME, META_DB_NAME
from tests.helpers.store import (
    SSD_HEADER,
    TINY8,
    Session,
    build_session,
    check_chunk,
    load,
    store_config,
    token_stream,
    unframe,
)

NS = "crash"
SESSION_IDS = ("s0", "s1", "s2")
CT = 16
REPO = Path(__file__).resolve().parents[2]
FORKER = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.reliability import test_crash; "
          "test_crash.forker_main()")
LINE_TIMEOUT_S = 60.0  # a hang guard only: a healthy writer prints a line every few ms


def crash_config(root: Path) -> StoreConfig:
    return store_config(root, zstd_level=3, chunk_tokens=CT)  # durable writes: sync=True by default


def crash_session(sid: str, version: int) -> Session:
    """Version ``v`` of a session: versions grow one history by two chunks at a time, and every third
    version starts a new history (so commits also free chunks). Chunk 0 of each history is shared
    by all sessions, the rest is their own; the tail length varies."""
    history, step = divmod(version, 3)
    shared = token_stream(10_000 + history, CT)
    own = token_stream(int(sid[1:]) * 1000 + history, 6 * CT)
    n_chunks = 2 + 2 * step
    ids = np.concatenate([shared, own])[: n_chunks * CT + (version * 3) % CT]
    return build_session(NS, sid, ids, chunk_tokens=CT)


# -- the child ----------------------------------------------------------------------------------------
def child_main(argv: list[str]) -> None:
    """Save forever (until killed). ``pause`` = ``partial:N`` or ``saved:N`` parks the child at a
    known point of its N-th save (after its first new chunk, or after all its chunks but before the
    commit) for the parent to kill it there; ``turn`` saves each version in one call
    (``save_session``: the new chunks and the manifest in one transaction)."""
    root, pause = Path(argv[0]), argv[1]
    pause_kind, _, n = pause.partition(":")
    pause_at = int(n) if n else -1
    sessions = open_store(crash_config(root))
    emit("ready")
    saves = 0
    for _ in range(200):
        for sid in SESSION_IDS:
            try:
                m = sessions.get(NS, sid)
                version, old = int(m.metadata["version"]) + 1, m.chunk_keys
            except NotFound:
                version, old = 0, ()
            s = crash_session(sid, version)
            first = 0
            while first < min(len(old), len(s.keys)) and old[first] == s.keys[first]:
                first += 1  # incremental: only chunks past the common prefix travel
            saves += 1
            emit(f"saving {sid} {version}")
            if pause_kind == "turn":
                sessions.save_session(NS, TINY8.layout_id, s.parent(first), first, s.blobs[first:],
                                      s.manifest(version=version))
                emit(f"committed {sid} {version}")
                continue
            written = 0
            for i in range(first, len(s.keys)):  # one call per chunk: a kill can land between them
                written += sessions.save_chunks(NS, TINY8.layout_id, s.parent(i), i, [s.blobs[i]]).written
                if pause_kind == "partial" and saves >= pause_at and written:
                    _park()
            if pause_kind == "saved" and saves >= pause_at and written:
                _park()
            sessions.commit(s.manifest(version=version))
            emit(f"committed {sid} {version}")
    emit("done")


def emit(line: str) -> None:
    """One write(2) per line: a SIGKILL can land between print()'s writes and leave half a line."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def _park() -> None:
    emit("parked")
    time.sleep(LINE_TIMEOUT_S)


def forker_main() -> None:
    """Read commands on stdin: ``spawn <root> <pause>`` forks a writer running :func:`child_main`;
    ``kill`` SIGKILLs it and reaps it (so its pid cannot be reused before the kill lands)."""
    writer = 0
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "spawn":
            writer = os.fork()
            if writer == 0:  # the writer: never returns into this loop
                code = 0
                try:
                    child_main(args)
                except BaseException:
                    emit("crashed " + traceback.format_exc().replace("\n", " | ")[-3000:])
                    code = 1
                finally:
                    os._exit(code)
        elif cmd == "kill":
            os.kill(writer, signal.SIGKILL)
            _, status = os.waitpid(writer, 0)
            emit(f"killed {status}")


# -- the test -------------------------------------------------------------------------------------------
@dataclass
class Forker:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    history: deque[str] = field(default_factory=lambda: deque(maxlen=20))  # for failure messages

    @classmethod
    def start(cls) -> Forker:
        proc = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=REPO)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.strip())
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        return cls(proc, lines)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=LINE_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"no line in {LINE_TIMEOUT_S} s; the last ones: {list(self.history)}") from None
        if line is None:
            raise AssertionError(f"the forker exited with {self.proc.wait()}")
        if line.startswith("crashed"):
            raise AssertionError(f"the writer failed: {line}")
        self.history.append(line)
        return line

    def kill_writer(self) -> list[str]:
        """SIGKILL the writer; returns every line it printed that was not read yet."""
        self.send("kill")
        rest = []
        while not (line := self.next_line()).startswith("killed "):
            rest.append(line)
        return rest

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def kill_plan(rng: random.Random) -> list[tuple[str, float]]:
    """Ten kill points of five kinds, in a shuffled order: (kind, parameter)."""
    plan = [("after-commit", rng.randint(1, 6)) for _ in range(3)]  # right after the N-th commit
    plan += [("in-save", rng.randint(1, 6)) for _ in range(2)]  # 0-3 ms after the N-th "saving"
    plan += [("delay", rng.uniform(0.01, 0.25)) for _ in range(2)]  # a random time after start
    plan += [("partial", rng.randint(1, 4)), ("saved", rng.randint(1, 4)), ("partial", rng.randint(5, 9))]
    rng.shuffle(plan)
    return plan


def run_until_killed(forker: Forker, root: Path, kind: str, param: float, rng: random.Random,
                     turns: bool = False) -> list[str]:
    """Start a writer, kill it at the planned point, return every line it printed."""
    pause = f"{kind}:{int(param)}" if kind in ("partial", "saved") else "turn" if turns else "none"
    forker.send(f"spawn {root} {pause}")
    assert forker.next_line() == "ready"
    seen: list[str] = []
    if kind == "delay":
        time.sleep(param)
    else:
        want = {"after-commit": "committed", "in-save": "saving", "partial": "parked", "saved": "parked"}[kind]
        count = int(param) if kind in ("after-commit", "in-save") else 1
        while count:
            line = forker.next_line()
            seen.append(line)
            count -= line.split()[0] == want
        if kind == "in-save":
            time.sleep(rng.uniform(0, 0.003))
    return seen + forker.kill_writer()


def raw_lmdb(path: str) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """What the ssd tier holds, read straight from LMDB: (chunk key -> value, manifest key -> value),
    from its two sub-databases."""
    env = lmdb.open(path, max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(DB_NAME, create=False)) as txn:
            chunks = {bytes(k): unframe(bytes(v)) for k, v in txn.cursor()}
        with env.begin(db=env.open_db(META_DB_NAME, create=False)) as txn:
            metas = {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()
    assert all(len(k) == 16 for k in chunks), "unexpected keys among the chunks"
    assert all(k.startswith(KEY_PREFIX) for k in metas), "unexpected keys among the manifests"
    return chunks, metas


def check_wreck(root: Path, acked: dict[str, int]) -> int:
    """Everything the crash contract promises; returns how many orphan chunks the open collected."""
    cfg = crash_config(root)
    chunks_before, metas = raw_lmdb(cfg.tiers[1].path)  # type: ignore[union-attr]
    for key, blob in chunks_before.items():  # never a torn chunk on disk, committed or not
        assert chunk.decode(blob, TINY8).key == key
    for blob in metas.values():
        Manifest.decode(blob)

    sessions: SessionStore = open_store(cfg)
    try:
        found = {m.session_id: m for m in sessions.list_sessions(NS)}
        versions = {sid: int(m.metadata["version"]) for sid, m in found.items()}
        for sid, v in acked.items():
            assert versions.get(sid, -1) >= v, f"{sid}: committed version {v} acknowledged, store has {versions}"
        for sid, m in found.items():
            s = crash_session(sid, versions[sid])
            assert (m.chunk_keys, m.tail, m.token_count) == (s.keys, s.tail, len(s.token_ids))
            for i, (key, blob) in enumerate(load(sessions, m.namespace, m.chunk_keys)):
                check_chunk(blob, TINY8, key, s.chunk_ids(i))
        live = set(sessions.live_chunks())
        assert sessions.store.chunk_keys(local_only=True) == live  # the interrupted save's garbage is gone
        for c in sessions.store.counters.values():
            assert (c.verify_failures, c.errors) == (0, 0)
        return len(set(chunks_before) - live)
    finally:
        sessions.store.close()


def test_sigkill_mid_save_never_loses_or_tears_a_commit(tmp_path: Path) -> None:
    rng = random.Random(20260131)
    acked: dict[str, int] = {}
    forker = Forker.start()
    try:
        for n, (kind, param) in enumerate(kill_plan(rng)):
            lines = run_until_killed(forker, tmp_path, kind, param, rng)
            assert "done" not in lines, "the writer finished before it was killed"
            for line in lines:
                word, *rest = line.split()
                if word == "committed":
                    acked[rest[0]] = max(acked.get(rest[0], -1), int(rest[1]))
            orphans = check_wreck(tmp_path, acked)
            if kind in ("partial", "saved"):
                assert orphans > 0, f"kill point {n} ({kind}) left no uncommitted chunks to collect"
    finally:
        forker.stop()
    assert len(acked) == len(SESSION_IDS) and min(acked.values()) >= 2, f"too little progress: {acked}"


def test_sigkill_mid_turn_save_leaves_the_old_version_or_the_new_one(tmp_path: Path) -> None:
    """One-call turn saves (chunks and manifest in one transaction): a kill at any point leaves
    every acknowledged version (or a later one), whole. (Chunks an old version alone used are
    freed after the commit: a kill in between leaves them for the next open to collect.)"""
    rng = random.Random(20261130)
    acked: dict[str, int] = {}
    plan = [p for p in kill_plan(rng) if p[0] not in ("partial", "saved")]  # a turn has no midpoint
    forker = Forker.start()
    try:
        for kind, param in plan:
            lines = run_until_killed(forker, tmp_path, kind, param, rng, turns=True)
            assert "done" not in lines, "the writer finished before it was killed"
            assert not any(line.startswith("crashed") for line in lines), lines
            for line in lines:
                word, *rest = line.split()
                if word == "committed":
                    acked[rest[0]] = max(acked.get(rest[0], -1), int(rest[1]))
            check_wreck(tmp_path, acked)
    finally:
        forker.stop()
    assert len(acked) == len(SESSION_IDS) and min(acked.values()) >= 2, f"too little progress: {acked}"


def test_check_wreck_catches_a_torn_chunk(tmp_path: Path) -> None:
    """The checker itself: a chunk cut short inside LMDB (what a non-atomic store could leave) fails."""
    cfg = crash_config(tmp_path)
    sessions = open_store(cfg)
    s = crash_session("s0", 0)
    sessions.save_chunks(NS, TINY8.layout_id, ROOT, 0, list(s.blobs))
    sessions.commit(s.manifest(version=0))
    sessions.store.close()
    torn = s.blobs[1][:-100]
    env = lmdb.open(cfg.tiers[1].path, max_dbs=8)  # type: ignore[union-attr]
    with env.begin(write=True, db=env.open_db(DB_NAME)) as txn:
        txn.put(s.keys[1], SSD_HEADER.pack(0, len(torn), len(torn)) + torn)  # well framed, torn inside
    env.close()
    with pytest.raises(chunk.TruncatedChunk):
        check_wreck(tmp_path, {"s0": 0})
