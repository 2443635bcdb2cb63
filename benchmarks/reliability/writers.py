"""Writer threads for the SIGKILL storm: each owns a few sessions and saves, commits, deletes,
evicts and re-reads them through its own ``Client`` while the daemon may die under it. A version
is saved as chunks then a commit, or (where the client has it) as one turn save.

Writers run only while the gate is open. The harness kills the daemon, closes the gate, waits
until no operation is in flight, restarts and checks the daemon, hands every writer a new client
and opens the gate again. An operation that fails goes on the record (with the time it failed, so
the harness can tell an error caused by its kill from one the daemon gave while alive) and the
writer waits for the next generation.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from benchmarks.reliability.oracle import ABSENT, CheckReport, Oracle
from kvstore.client import Client
from kvstore.errors import KvstoreError, NotFound
from kvstore.format.keys import ROOT

Ref = tuple[str, str]
OPS = ("commit", "delete", "evict", "read")
WEIGHTS = (0.55, 0.15, 0.15, 0.15)


@dataclass(frozen=True)
class OpError:
    generation: int
    at: float  # time.monotonic() when it failed
    op: str
    error: str


class Gate:
    """Open while the daemon of ``generation`` is up; counts operations in flight."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.open = False
        self.stopped = False
        self.busy = 0
        self.generation = 0
        self.clients: list[Client | None] = []
        self.listeners: dict[str, threading.Event] = {}

    def enter(self, index: int) -> tuple[int, Client] | None:
        with self.cond:
            while not self.open and not self.stopped:
                self.cond.wait()
            if self.stopped:
                return None
            self.busy += 1
            client = self.clients[index]
            assert client is not None
            return self.generation, client

    def leave(self) -> None:
        with self.cond:
            self.busy -= 1
            self.cond.notify_all()

    def wait_next(self, generation: int) -> None:
        with self.cond:
            while self.generation == generation and not self.stopped:
                self.cond.wait()

    def close_and_drain(self) -> None:
        with self.cond:
            self.open = False
            while self.busy:
                self.cond.wait()

    def reopen(self, clients: list[Client | None]) -> None:
        with self.cond:
            self.clients = clients
            self.generation += 1
            self.open = True
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def about_to(self, op: str) -> None:
        """A writer is about to send ``op``: wake a harness waiting to kill the daemon right then."""
        event = self.listeners.get(op)
        if event is not None:
            event.set()


class Writer(threading.Thread):
    def __init__(self, index: int, refs: list[Ref], oracle: Oracle, gate: Gate, seed: int,
                 on_violation: Callable[[str], None], evict_to: tuple[str, ...] = ("ssd",)) -> None:
        super().__init__(name=f"storm-writer-{index}", daemon=True)
        self.index, self.refs, self.oracle, self.gate = index, refs, oracle, gate
        self.rng = random.Random(seed)
        self.on_violation = on_violation
        self.evict_to = evict_to
        self.errors: list[OpError] = []
        self.acked = {op: 0 for op in OPS}
        self.next_version = dict.fromkeys(refs, 0)
        self.read_report = CheckReport()

    def run(self) -> None:
        while (entered := self.gate.enter(self.index)) is not None:
            generation, client = entered
            ref = self.rng.choice(self.refs)
            op = self.rng.choices(OPS, WEIGHTS)[0]
            allowed = self.oracle.allowed(ref)
            if allowed == {ABSENT}:
                op = "commit"
            try:
                getattr(self, op)(client, ref, allowed)
                self.acked[op] += 1
                failed = False
            except (KvstoreError, grpc.RpcError) as e:
                self.errors.append(OpError(generation, time.monotonic(), op, f"{type(e).__name__}: {e}"))
                failed = True
            finally:
                self.gate.leave()
            if failed:
                self.gate.wait_next(generation)

    def commit(self, client: Client, ref: Ref, allowed: set[int]) -> None:
        number = self.next_version[ref]
        self.next_version[ref] += 1
        v = self.oracle.version(ref, number)
        first = 0
        if len(allowed) == 1 and ABSENT not in allowed and self.rng.random() < 0.5:
            old = self.oracle.version(ref, next(iter(allowed))).keys  # stored: send only what is new
            while first < min(len(old), len(v.keys)) and old[first] == v.keys[first]:
                first += 1
        if hasattr(client, "save_session") and self.rng.random() < 0.5:
            # a turn in one call: the new chunks and the manifest, committed by the daemon
            self.oracle.begin(ref, number)
            self.gate.about_to(self.rng.choice(("save", "commit")))
            # base=0: each session has this one writer, whose last save may have landed unacknowledged
            # (the daemon killed before its answer): the storm checks durability, not version races
            client.save_session(v.manifest, list(v.blobs[first:]), base=0)
            self.oracle.ack(ref, number)
            return
        self.gate.about_to("save")
        client.save_chunks(ref[0], v.manifest.layout_id, v.parent(first) if first else ROOT, first,
                           list(v.blobs[first:]))
        self.oracle.begin(ref, number)
        self.gate.about_to("commit")
        client.commit(v.manifest, base=0)
        self.oracle.ack(ref, number)

    def delete(self, client: Client, ref: Ref, allowed: set[int]) -> None:
        self.oracle.begin(ref, ABSENT)
        self.gate.about_to("delete")
        try:
            client.delete_session(*ref)
        except NotFound:
            if ABSENT not in allowed:
                self.on_violation(f"{ref}: LOST: delete answered NOT_FOUND; it must exist (states {sorted(allowed)})")
        self.oracle.ack(ref, ABSENT)

    def evict(self, client: Client, ref: Ref, allowed: set[int]) -> None:
        self.gate.about_to("evict")
        try:
            client.evict(*ref, self.rng.choice(self.evict_to))
        except NotFound:
            if ABSENT not in allowed:
                self.on_violation(f"{ref}: LOST: evict answered NOT_FOUND; it must exist (states {sorted(allowed)})")

    def read(self, client: Client, ref: Ref, allowed: set[int]) -> None:
        seen, problem = self.oracle.read(client, ref, self.read_report)
        if problem or seen not in allowed:
            self.on_violation(f"{ref}: a live read served {'nothing' if seen == ABSENT else f'version {seen}'} "
                              f"{problem} (allowed {sorted(allowed)})")
