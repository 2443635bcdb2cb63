"""The line protocol between ``bench_peers.py`` and its client processes (standard library only).

Why a protocol of its own: LMCache's clients run in a separate virtual environment (its pinned
dependencies beside kvstore's), so the clients cannot be ``multiprocessing`` children of the
benchmark. Each client process reads one JSON command a line on stdin and answers one line on
stdout starting with ``@@`` (libraries may print other lines; the benchmark skips them). A timed op
answers its ``time.perf_counter()`` start and end: CLOCK_MONOTONIC, one clock for every process on
the host, so the benchmark takes a round's wall time as the last end minus the first start.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

PREFIX = "@@"
Op = Callable[[], object]
Handler = Callable[[dict[str, Any]], Any]


def reply(value: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps(value) + "\n")
    sys.stdout.flush()


def serve(setup: Handler, ops: Callable[[], dict[str, tuple[Op, Op | None]]], prepare: Handler) -> None:
    """Answer commands until ``quit`` or end of input: ``setup`` (its answer is sent back),
    ``prepare`` (untimed: store what the loads will read), or the name of a timed op, which answers
    ``[start, end]`` and then runs its untimed cleanup. An exception answers ``{"error": traceback}``."""
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd["op"]
        if name == "quit":
            reply("bye")
            return
        try:
            if name == "setup":
                reply(setup(cmd))
            elif name == "prepare":
                reply(prepare(cmd))
            else:
                fn, cleanup = ops()[name]
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                if cleanup is not None:
                    cleanup()
                reply([t0, t1])
        except Exception:
            reply({"error": traceback.format_exc()})
