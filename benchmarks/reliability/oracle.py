"""What each session may look like after a crash, and the check that compares it with the daemon.

A session's state is ``ABSENT`` or a version number. The oracle keeps, per session, the set of
states it may be in: an acknowledged operation collapses the set to its result; an operation in
flight or one that failed (the daemon died under it) adds its result as a possibility, since it may
or may not have landed. A check after a restart reads every session through the daemon and fails
if what it sees is not an allowed state, or is an allowed version that is not complete and
bit-exact (manifest, every chunk, and the chunks a Lookup finds). What it saw is durable, so the
set collapses to it: a later crash must not take it back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from benchmarks.reliability.workload import Version, same_manifest, version
from kvstore.client import Client
from kvstore.errors import NotFound

ABSENT = -1


@dataclass
class SessionState:
    namespace: str
    session_id: str
    allowed: set[int] = field(default_factory=lambda: {ABSENT})
    next_version: int = 0


@dataclass
class CheckReport:
    sessions: int = 0  # sessions checked
    present: int = 0  # of which were stored (the rest correctly absent)
    acked_checked: int = 0  # sessions whose state was exactly known (acknowledged) when checked
    chunks: int = 0  # chunks loaded and compared
    violations: list[str] = field(default_factory=list)


class Oracle:
    def __init__(self, seed: int, sessions: list[tuple[str, str]]) -> None:
        self.seed = seed
        self.states = {(ns, sid): SessionState(ns, sid) for ns, sid in sessions}
        self._lock = threading.Lock()

    def version(self, ref: tuple[str, str], number: int) -> Version:
        return version(self.seed, ref[0], ref[1], number)

    def begin(self, ref: tuple[str, str], result: int) -> None:
        """An operation that may turn the session into ``result`` is about to be sent."""
        with self._lock:
            self.states[ref].allowed.add(result)

    def ack(self, ref: tuple[str, str], result: int) -> None:
        with self._lock:
            self.states[ref].allowed = {result}

    def allowed(self, ref: tuple[str, str]) -> set[int]:
        with self._lock:
            return set(self.states[ref].allowed)

    def check(self, client: Client) -> CheckReport:
        """Read every session through the daemon (no writer may run meanwhile)."""
        report = CheckReport()
        listed = {(s.namespace, s.session_id) for s in client.list_sessions()}
        for ref in sorted(listed - set(self.states)):
            report.violations.append(f"{ref}: listed, but no writer ever saved it")
        for ref, state in sorted(self.states.items()):
            report.sessions += 1
            allowed = self.allowed(ref)
            report.acked_checked += len(allowed) == 1
            seen, problem = self.read(client, ref, report)
            if not problem and (seen != ABSENT) != (ref in listed):
                problem = "loadable but not listed" if ref not in listed else "listed but not loadable"
            if problem:
                report.violations.append(f"{ref}: {problem} (allowed states {sorted(allowed)})")
            elif seen not in allowed:
                what = "LOST: acknowledged state" if len(allowed) == 1 else "none of the possible states"
                report.violations.append(f"{ref}: {what} {sorted(allowed)} expected, the daemon has "
                                         f"{'nothing' if seen == ABSENT else f'version {seen}'}")
            with self._lock:
                state.allowed = {seen}  # durable now; after a violation, report each loss once
            report.present += seen != ABSENT
        return report

    def read(self, client: Client, ref: tuple[str, str], report: CheckReport) -> tuple[int, str]:
        """(the version the daemon serves or ABSENT, a problem or ""): the whole session is loaded
        and compared with what its writer saved."""
        ns, sid = ref
        try:
            manifest, chunks = client.load_session(ns, sid)
        except NotFound:
            return ABSENT, ""
        try:
            number = int(manifest.metadata.get("v", ""))
        except ValueError:
            return ABSENT, f"a manifest no writer wrote (metadata {manifest.metadata})"
        want = self.version(ref, number)
        if not same_manifest(manifest, want.manifest):
            return number, f"version {number}'s manifest differs from what was committed"
        got = {i: bytes(b) for i, b in chunks}
        report.chunks += len(got)
        if sorted(got) != list(range(len(want.keys))):
            return number, f"version {number} half-visible: chunks {sorted(got)} of {len(want.keys)} served"
        bad = [i for i, b in got.items() if b != want.blobs[i]]
        if bad:
            return number, f"version {number}: CORRUPT chunks {bad} served"
        hit = client.lookup(ns, want.manifest.layout_id, want.token_ids)
        if hit.chunks < len(want.keys):
            return number, f"version {number}: Lookup finds {hit.chunks} of its {len(want.keys)} chunks"
        return number, ""
