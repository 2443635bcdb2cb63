"""One (geometry, policy) store of the agent workload: a real daemon and the policy's saves.

Policies, on the same store (a ``kvstore serve`` daemon each, identical flags, own data dir):
- ``kvstore``: the session's global KV only (complete chunks + the tail in the manifest), saved at
  every boundary; SWA is rebuilt by bounded replay on resume, so nothing else is stored.
- ``v4``: the same saves, plus an SWA snapshot at every boundary, stored as a pseudo-session of
  the same store (namespace ``<ns>-swa``, id ``<session>.b<k>``, fresh random token ids so it
  never dedups) whose chunks carry as many payload bytes as the snapshot (PAPER.md: V4-Flash
  43 x 128 x 584 = 3,214,336 B; tiny-16 16 x 128 x 132 = 270,336 B). Snapshots live and die with
  their session: deleted with it, given its TTL, evicted with it; a resume loads the global KV
  and the latest snapshot.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.agent.agent_workload_chunks import ChunkMaker, snapshot_shape
from kvstore.client import Client
from kvstore.format.layout import Layout
from kvstore.format.manifest import Manifest, Retention
from kvstore.server.process import DaemonProcess

NS = "agents"
SWA_NS = "agents-swa"


@dataclass(frozen=True)
class StoreSpec:
    name: str  # row label
    geometry: str  # "real" | "tiny-16"
    policy: str  # "kvstore" | "v4"
    layout: Layout  # of the global KV
    snapshot_layout: Layout | None  # pseudo-chunks of the SWA snapshot (v4 only)
    snapshot_bytes: int  # payload bytes of one SWA snapshot (0: none)
    host_capacity: int
    chunk_tokens: int = 256


def du_bytes(path: Path) -> tuple[int, int]:
    """(allocated bytes, apparent bytes) of every file under ``path``: ``du -sB1`` and ``du -sb``."""
    alloc = apparent = 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(root, f))
            alloc += st.st_blocks * 512
            apparent += st.st_size
    return alloc, apparent


@dataclass
class Store:
    spec: StoreSpec
    data_dir: Path
    daemon: DaemonProcess = field(init=False)
    client: Client = field(init=False)
    maker: ChunkMaker = field(init=False)
    snap_maker: ChunkMaker | None = field(init=False)
    snap_shape: tuple[int, int] = field(init=False)  # (chunks, tail tokens) of one snapshot pseudo-session
    chunk_sizes: dict[bytes, int] = field(default_factory=dict)  # every chunk ever sent: encoded bytes
    session_keys: dict[str, tuple[bytes, ...]] = field(default_factory=dict)  # live sessions (both namespaces)
    snapshots: dict[int, list[str]] = field(default_factory=dict)  # workload session -> its snapshot ids
    manifest_bytes: dict[str, int] = field(default_factory=dict)
    tail_tokens: dict[str, int] = field(default_factory=dict)
    sent: int = 0  # chunks sent in saves
    written: int = 0  # of those, new to the store
    resumes: dict[str, list[float]] = field(default_factory=lambda: {"plain": [], "prefetch": []})

    def __post_init__(self) -> None:
        s = self.spec
        self.daemon = DaemonProcess(self.data_dir, ["--host-capacity-bytes", str(s.host_capacity),
                                                    "--chunk-tokens", str(s.chunk_tokens)]).start()
        self.client = Client(address=self.daemon.address)
        self.maker = ChunkMaker(s.layout, s.chunk_tokens, seed=1)
        self.snap_maker = ChunkMaker(s.snapshot_layout, s.chunk_tokens, seed=2) if s.snapshot_layout else None
        self.snap_shape = snapshot_shape(s.snapshot_layout, s.chunk_tokens, s.snapshot_bytes) if s.snapshot_layout \
            else (0, 0)

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()

    # -- saves ----------------------------------------------------------------------------------
    def _save(self, ns: str, sid: str, ids: np.ndarray, maker: ChunkMaker, first: int) -> None:
        keys, blobs, tail = maker.sequence(ns, ids, first)
        for k, b in zip(keys[first:], blobs):
            self.chunk_sizes[k] = len(b)
        m = Manifest(sid, ns, maker.layout.layout_id, len(ids), maker.chunk_tokens, tuple(keys), tail,
                     tuple(int(t) for t in ids[-128:]))
        saved = self.client.save_session(m, blobs)
        self.sent += len(blobs)
        self.written += saved.written
        self.session_keys[f"{ns}/{sid}"] = tuple(keys)
        self.manifest_bytes[f"{ns}/{sid}"] = len(saved.manifest.encode())
        self.tail_tokens[f"{ns}/{sid}"] = m.tail_tokens

    def save_turn(self, session: int, ids: np.ndarray, prev_tokens: int) -> None:
        """A boundary: the new complete chunks and the manifest; for v4 also an SWA snapshot."""
        first = 0 if prev_tokens == 0 else prev_tokens // self.spec.chunk_tokens
        self._save(NS, f"s{session}", ids, self.maker, first)
        if self.snap_maker is not None:
            snaps = self.snapshots.setdefault(session, [])
            sid = f"s{session}.b{len(snaps)}"
            n, tail = self.snap_shape
            rng = np.random.default_rng([7, session, len(snaps)])
            self._save(SWA_NS, sid, rng.integers(0, 129_280, n * self.spec.chunk_tokens + tail).astype(np.uint32),
                       self.snap_maker, 0)
            snaps.append(sid)

    # -- the session's life ---------------------------------------------------------------------
    def _refs(self, session: int) -> list[tuple[str, str]]:
        return [(NS, f"s{session}"), *((SWA_NS, s) for s in self.snapshots.get(session, []))]

    def _resume_refs(self, session: int) -> list[tuple[str, str]]:
        """What a resume needs: the global KV, and (v4) the latest snapshot."""
        refs = self._refs(session)
        return [refs[0], refs[-1]] if self.snap_maker is not None else refs

    def pause(self, session: int) -> None:
        """Memory pressure: what a resume needs goes down to the ssd tier."""
        for ns, sid in self._resume_refs(session):
            self.client.evict(ns, sid, "ssd")

    def resume(self, session: int, prefetch: bool, pause_s: float) -> None:
        """Load what a resume needs (global KV; v4: + the latest snapshot); timed. With ``prefetch``,
        the scheduler's hint goes out ``pause_s`` before the load."""
        refs = self._resume_refs(session)
        if prefetch:
            for ns, sid in refs:
                self.client.prefetch(ns, sid)
            time.sleep(pause_s)
        t = time.perf_counter()
        for ns, sid in refs:
            m, pairs = self.client.load_session(ns, sid)
            if sum(1 for _ in pairs) != len(m.chunk_keys):
                raise RuntimeError(f"resume of {ns}/{sid}: chunks missing")
        self.resumes["prefetch" if prefetch else "plain"].append(time.perf_counter() - t)

    def finish(self, session: int, fate: str, ttl_s: float) -> None:
        for ns, sid in self._refs(session):
            if fate == "delete":
                self.client.delete_session(ns, sid)
            elif fate == "ttl":
                self.client.touch_session(ns, sid, Retention(ttl_s=ttl_s))
            if fate != "keep":
                self.session_keys.pop(f"{ns}/{sid}")
                self.manifest_bytes.pop(f"{ns}/{sid}")
                self.tail_tokens.pop(f"{ns}/{sid}")

    # -- what is stored -------------------------------------------------------------------------
    def expired_reclaimed(self) -> int:
        """Sessions the daemon's maintenance pass has expired so far (from its log)."""
        n = 0
        for line in self.daemon.log().splitlines():
            if "maintenance: expired" in line:
                n += int(line.split("maintenance: expired", 1)[1].split()[0])
        return n

    def live_bytes(self) -> dict[str, int]:
        """Encoded (uncompressed) bytes of live sessions, by what they are: unique chunks of the
        global KV and of snapshots, manifests, and what dedup saved (chunks referenced again); and
        the live tokens of the workload, each shared chunk counted once (snapshot pseudo-tokens not)."""
        out = {"global_chunks": 0, "snapshot_chunks": 0, "manifests_global": 0, "manifests_snapshot": 0,
               "dedup_saved": 0, "global_refs": 0, "tokens": 0, "snapshots": 0}
        seen: set[bytes] = set()
        for ref, keys in self.session_keys.items():
            snap = ref.startswith(SWA_NS + "/")
            out["manifests_snapshot" if snap else "manifests_global"] += self.manifest_bytes[ref]
            out["tokens"] += 0 if snap else self.tail_tokens[ref]
            out["snapshots"] += snap
            for k in keys:
                size = self.chunk_sizes[k]
                if not snap:
                    out["global_refs"] += size
                if k in seen:
                    out["dedup_saved"] += size
                    continue
                seen.add(k)
                out["snapshot_chunks" if snap else "global_chunks"] += size
                out["tokens"] += 0 if snap else self.spec.chunk_tokens
        return out


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``xs`` (nearest rank), nan when empty."""
    if not xs:
        return float("nan")
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if q != 0.5 else statistics.median(xs)
