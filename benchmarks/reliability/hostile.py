"""Hostile arenas: a client of the daemon's own user doing its worst to its arena, round after round,
while another tenant's same-host client loads and verifies its session without pause.

Every case of ``hostile_client.py`` runs in a process of its own against one real ``kvstore serve``
(with tokens: the hostile client's namespace, the victim's). After each, the daemon must be alive and
every step must have got the answer ``EXPECTED`` names for it: before the fix, a truncated arena
killed the daemon with SIGBUS at the next load or save through it, for every tenant. The victim (its
own ``Client``: a sealed arena and the local socket) loads its session in a loop and compares every
byte; any error or mismatch counts. At the end the daemon's open fds are compared with their count
before the first case, less one per arena it still holds (the hostile client never detaches its
own; they go when idle), so no fd passed to it may be kept; then it is stopped with SIGTERM: it must
exit cleanly.

    from benchmarks.reliability.hostile import HostileConfig, run_hostile
    result = run_hostile(HostileConfig(rounds=3), workdir)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from benchmarks.reliability.launcher import daemon, describe_exit, make_spawner
from benchmarks.reliability.workload import CHUNK_TOKENS, Version, version
from kvstore.client import Client
from kvstore.format.manifest import Manifest
from kvstore.server.process import clean_env

REPO = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).resolve().with_name("hostile_client.py")
TOKENS = '[tokens]\n"tok-evil" = ["evil"]\n"tok-good" = ["good"]\n"tok-admin" = ["*"]\n'
CALLS = [f"{m} {t}" for t in ("grpc", "local") for m in ("LoadChunks", "LoadSession", "SaveChunks")]
FAILURES = ("INTERNAL", "UNKNOWN", "UNAVAILABLE", "DEADLINE_EXCEEDED", "OSError")  # a daemon's failure or a dead one

# What each step of each case must answer: (code, a part of its message); None: any status but a
# failure of the daemon; a set: a step repeated while the file is truncated, each answer one of these
Want = tuple[str, str] | None | frozenset[str]
TRUNCATED = ("FAILED_PRECONDITION", "the arena file cannot be used: it was truncated")
UNKNOWN = ("INVALID_ARGUMENT", "unknown arena")
EXPECTED: dict[str, dict[str, Want]] = {
    "file_truncated": {"attach": ("OK", ""), **{c: TRUNCATED for c in CALLS}},
    "file_holes": {"attach": ("OK", ""), **{c: ("OK", "") for c in CALLS}},
    "file_sparse": {"attach": ("INVALID_ARGUMENT", "is sparse"), **{c: UNKNOWN for c in CALLS}},
    # a save may read the zeros of a file truncated and extended again: refused as not a chunk
    "file_truncated_in_flight": {"attach": ("OK", ""), "ftruncate": frozenset({"OK"}),
                                 **{c: frozenset({"OK", "FAILED_PRECONDITION", "INVALID_ARGUMENT"}) for c in CALLS}},
    "sealed_truncated": {"attach": ("OK", ""), "ftruncate": ("OSError", "Operation not permitted"),
                         **{c: ("OK", "") for c in CALLS}},
    "sealed_holes": {"attach": ("OK", ""), **{c: None for c in CALLS}},
    "sealed_truncated_in_flight": {"attach": ("OK", ""), "ftruncate": frozenset({"OSError"}),
                                   **{c: frozenset({"OK"}) for c in CALLS}},
    "memfd_unsealed": {"attach": ("INVALID_ARGUMENT", "not sealed against shrinking"), **{c: UNKNOWN for c in CALLS}},
    "memfd_sparse": {"attach": ("INVALID_ARGUMENT", "is sparse")},
    "memfd_hugetlb": {"attach": ("INVALID_ARGUMENT", "hugetlbfs")},
    "not_memfds": {"pipe": ("INVALID_ARGUMENT", "not a regular file"),
                   "shm file": ("INVALID_ARGUMENT", "not sealed against shrinking"),
                   "disk file": ("INVALID_ARGUMENT", "not a memfd on tmpfs"),
                   "directory": ("INVALID_ARGUMENT", "not a regular file"),
                   "two fds": ("INVALID_ARGUMENT", "one memfd, not 2 fds"),
                   "memfd and a path": ("INVALID_ARGUMENT", "one or the other"),
                   "wrong size": ("INVALID_ARGUMENT", "is 1048576 bytes, not 2097152"),
                   "wrong nonce": ("INVALID_ARGUMENT", "does not hold the nonce")},
    "fds_with_other_calls": {f"GetServerInfo {i}": ("OK", "") for i in range(64)},
    "nul_paths": {f"{w} {t}": ("INVALID_ARGUMENT", "contains a NUL byte")
                  for w in ("dir", "name", "long") for t in ("grpc", "local")},
}
SKIPPED = "SKIPPED"


def check(case: str, answers: dict[str, list[str]]) -> list[str]:
    """What in ``answers`` (one run of ``case``) is not as ``EXPECTED``; [] when all is."""
    if answers.get("attach", [""])[0] == SKIPPED:
        return []
    want_all = EXPECTED[case]
    samples = {s: a[1] for s, a in answers.items() if a[0] == "SAMPLES"}  # why a repeated step failed
    answers = {s: a for s, a in answers.items() if a[0] != "SAMPLES"}
    problems = [f"{case}: step {s!r} missing" for s in want_all if s not in answers]
    problems += [f"{case}: unexpected step {s!r}" for s in answers if s not in want_all]
    for step, want in want_all.items():
        if step not in answers:
            continue
        code, details = answers[step]
        if isinstance(want, frozenset):
            counts = json.loads(details) if code == "COUNTS" else {code: 1}
            if code != "COUNTS" or not counts or set(counts) - want:
                problems.append(f"{case}: {step}: {code} {details[:200]}, expected only {sorted(want)}; "
                                f"{samples.get(step + ' samples', '')}")
        elif want is None:
            if code in FAILURES:
                problems.append(f"{case}: {step}: {code} {details[:200]}")
        elif code != want[0] or want[1] not in details:
            problems.append(f"{case}: {step}: {code} {details[:200]!r}, expected {want[0]} with {want[1]!r}")
    return problems


def calls_in(answers: dict[str, list[str]]) -> Counter[str]:
    """The answers by code, a repeated step's counts included."""
    codes: Counter[str] = Counter()
    for code, details in answers.values():
        if code != "SAMPLES":
            codes.update(json.loads(details) if code == "COUNTS" else {code: 1})
    return codes


def run_case(spec: Path, case: str, prefix: list[str] | None = None) -> dict[str, list[str]]:
    """One run of ``case`` in a hostile client process of its own; its answers, step by step."""
    done = subprocess.run([*(prefix or []), sys.executable, str(CLIENT), str(spec), case], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the hostile client failed ({case}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


class Saved(Protocol):
    """A session the hostile client's token saved (a workload Version, a test's SyntheticSession)."""

    @property
    def namespace(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def keys(self) -> Sequence[bytes]: ...
    @property
    def blobs(self) -> Sequence[bytes]: ...
    @property
    def manifest(self) -> Manifest: ...


def write_spec(path: Path, address: str, v: Saved, scratch: Path, **extra: object) -> Path:
    """The hostile client's SPEC: its token, and a session it saved (``v``)."""
    spec = {"address": address, "token": "tok-evil", "namespace": v.namespace, "session_id": v.session_id,
            "keys": [k.hex() for k in v.keys], "layout_id": v.manifest.layout_id.hex(), "blob": v.blobs[0].hex(),
            "scratch": str(scratch), **extra}
    path.write_text(json.dumps(spec))
    return path


@dataclass(frozen=True)
class HostileConfig:
    rounds: int = 3
    seconds: float = 1.0  # how long each in-flight case truncates under running calls
    seed: int = 0


@dataclass
class HostileResult:
    config: HostileConfig
    commit: str = ""
    cases_run: int = 0
    cases_skipped: int = 0
    steps: int = 0
    calls: int = 0  # answers the hostile client got, a repeated step's every call counted
    codes: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    daemon_deaths: int = 0
    victim_loads: int = 0
    victim_bytes: int = 0
    victim_errors: list[str] = field(default_factory=list)
    fds_before: int = 0
    fds_after: int = -1
    arenas_before: int = 0  # arenas the daemon holds: the hostile client never detaches its own
    arenas_after: int = 0

    @property
    def fds_kept(self) -> int:
        """Fds the daemon holds now beyond its arenas' (one each): fds passed to it and kept."""
        return (self.fds_after - self.fds_before) - (self.arenas_after - self.arenas_before)
    daemon_exit: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Victim:
    """Another tenant's same-host client, loading and comparing its session until stopped."""

    def __init__(self, address: str, v: Version) -> None:
        self.address, self.v = address, v
        self.loads = self.bytes = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with Client(address=self.address, token="tok-good", arena_bytes=4 << 20, retries=0) as c:
            while not self.stop.is_set():
                try:
                    _, chunks = c.load_session(self.v.namespace, self.v.session_id)
                    got = [bytes(b) for _, b in chunks]
                    if got != list(self.v.blobs):
                        self.errors.append("a load served other bytes than were saved")
                    self.loads += 1
                    self.bytes += sum(map(len, got))
                except Exception as e:
                    self.errors.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.01)
                if not c.uses_shared_memory:
                    self.errors.append("the victim is not on the same-host path")
                    return


def run_hostile(config: HostileConfig, workdir: Path) -> HostileResult:
    from benchmarks.reliability.provenance import git_commit

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tokens.toml").write_text(TOKENS)
    r = HostileResult(config, commit=git_commit())
    flags = ["--chunk-tokens", str(CHUNK_TOKENS), "--tokens-file", str(workdir / "tokens.toml"), "--log-format", "text"]
    d = daemon(make_spawner("exec"), workdir / "data", flags, workdir / "daemon.log").spawn()
    if not d.wait_ready(120):
        d.kill()
        raise RuntimeError(d.log()[-3000:])
    evil, good = version(config.seed, "evil", "e1", 3), version(config.seed, "good", "g1", 3)
    for token, v in (("tok-evil", evil), ("tok-good", good)):
        with Client(address=d.address, token=token, shared_memory=False) as c:
            c.save_session(v.manifest, list(v.blobs))
    spec = write_spec(workdir / "spec.json", d.address, evil, workdir, seconds=config.seconds)
    victim = Victim(d.address, good)
    victim.thread.start()
    while victim.loads == 0 and not victim.errors and victim.thread.is_alive():  # its arena attached
        time.sleep(0.01)
    t0 = time.monotonic()
    r.fds_before, r.arenas_before = _fds(d.pid), _arenas(d.address)
    codes: Counter[str] = Counter()
    try:
        for _ in range(config.rounds):
            for case in EXPECTED:
                if d.exited():
                    break
                answers = run_case(spec, case)
                skipped = answers.get("attach", [""])[0] == SKIPPED
                r.cases_skipped += skipped
                r.cases_run += not skipped
                r.steps += 0 if skipped else len(answers)
                codes.update(calls_in(answers) if not skipped else {})
                r.unexpected += check(case, answers)
                if d.exited():
                    r.daemon_deaths += 1
                    r.unexpected.append(f"the daemon died during {case}")
    finally:
        victim.stop.set()
        victim.thread.join(60)
        r.seconds = time.monotonic() - t0
        if not d.exited():
            r.fds_after, r.arenas_after = _fds(d.pid), _arenas(d.address)
        r.daemon_exit = describe_exit(d.stop(60))  # SIGTERM; SIGKILL after 60 s
    r.codes = dict(codes)
    r.calls = sum(codes.values())
    r.victim_loads, r.victim_bytes, r.victim_errors = victim.loads, victim.bytes, victim.errors[:20]
    log = (workdir / "daemon.log").read_text(errors="replace")
    if "Traceback" in log or "internal error" in log:
        r.unexpected.append("the daemon logged a traceback: " + log[-2000:])
    return r


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _arenas(address: str) -> int:
    """Arenas the daemon holds (each holds one fd: a mapping's, or a file arena's)."""
    with Client(address=address, token="tok-admin", shared_memory=False) as admin:
        return int(admin.stats().transport.arenas)
