"""The seeded agent workload of bench_agent_workload.py, as a list of events in token counts only.

Geometry-free on purpose: the same trace drives every (geometry, policy) store, so differences in
bytes are the policy's and the layout's, never the workload's. A session starts with a shared
system prompt (the dedup opportunity) plus a user message, then alternates model outputs and tool
outputs; every prompt end and every output end is a *boundary* (what a V4-Flash-style store
snapshots, and where every policy saves). Between turns a session may pause: its chunks are
evicted to the ssd tier and it is later resumed (loaded) before its next turn. A finished session
is kept, deleted, or given a short TTL (retention expiring).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 129_280


@dataclass(frozen=True)
class TraceConfig:
    """Workload shape. Token counts are per segment; medians of clipped log-normals."""

    sessions: int = 200
    seed: int = 0
    system_prompt_tokens: int = 2000  # shared by every session (not chunk-aligned: 7 of 256 shared)
    concurrency: int = 12  # sessions in flight at once
    turns: tuple[int, int] = (2, 7)  # tool turns per session, uniform inclusive
    user_tokens: tuple[int, int] = (64, 512)  # first user message, uniform
    output_median: int = 160  # model output (reasoning + tool call)
    tool_median: int = 700  # tool output (file contents, search results, logs)
    pause_p: float = 0.3  # after a tool turn: pause (evict to ssd), resume later
    delete_p: float = 0.25  # a finished session is deleted
    ttl_p: float = 0.3  # ... or given a short TTL (expires); the rest are kept
    ttl_s: float = 1.0


@dataclass(frozen=True)
class Event:
    """One step of one session. kind: start | grow | pause | resume | finish.
    grow: ``tokens`` new tokens, ending at a boundary of ``boundary`` ("prompt" or "output").
    finish: ``fate`` is keep | delete | ttl."""

    kind: str
    session: int
    tokens: int = 0
    boundary: str = ""
    fate: str = ""


def _lognormal(rng: np.random.Generator, median: int, lo: int, hi: int) -> int:
    return int(np.clip(round(median * float(np.exp(0.8 * rng.standard_normal()))), lo, hi))


def _session_plan(cfg: TraceConfig, rng: np.random.Generator, sid: int) -> list[Event]:
    user = int(rng.integers(cfg.user_tokens[0], cfg.user_tokens[1] + 1))
    plan = [Event("start", sid, cfg.system_prompt_tokens + user, "prompt")]
    for _ in range(int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))):
        plan.append(Event("grow", sid, _lognormal(rng, cfg.output_median, 16, 1200), "output"))
        plan.append(Event("grow", sid, _lognormal(rng, cfg.tool_median, 32, 6000), "prompt"))
        if rng.random() < cfg.pause_p:
            plan += [Event("pause", sid), Event("resume", sid)]
    plan.append(Event("grow", sid, _lognormal(rng, cfg.output_median, 16, 1200), "output"))  # the final answer
    u = rng.random()
    fate = "delete" if u < cfg.delete_p else "ttl" if u < cfg.delete_p + cfg.ttl_p else "keep"
    plan.append(Event("finish", sid, fate=fate))
    return plan


def build_trace(cfg: TraceConfig) -> list[Event]:
    """Every session's plan, interleaved: ``concurrency`` sessions in flight, each step taken by a
    random one of them; a paused session waits at least a few other steps before it resumes."""
    rng = np.random.default_rng(cfg.seed)
    plans = [_session_plan(cfg, rng, s) for s in range(cfg.sessions)]
    waiting = list(range(cfg.sessions))[::-1]
    active: list[int] = []
    cursor = [0] * cfg.sessions
    parked: dict[int, int] = {}  # session -> steps it still waits
    out: list[Event] = []
    while waiting or active:
        while waiting and len(active) < cfg.concurrency:
            active.append(waiting.pop())
        ready = [s for s in active if parked.get(s, 0) <= 0]
        for s in parked:
            parked[s] -= 1
        if not ready:
            continue
        s = ready[int(rng.integers(len(ready)))]
        ev = plans[s][cursor[s]]
        cursor[s] += 1
        out.append(ev)
        if ev.kind == "pause":
            parked[s] = int(rng.integers(3, 3 + 2 * cfg.concurrency))
        elif ev.kind == "resume":
            parked.pop(s, None)
        if cursor[s] == len(plans[s]):
            active.remove(s)
    return out


def token_ids(cfg: TraceConfig, session: int, start: int, n: int) -> np.ndarray:
    """Ids of tokens [start, start + n) of ``session``: the system prompt's are the same in every
    session (so its complete chunks are shared), the rest are the session's own."""
    ids = np.empty(n, np.uint32)
    sys_end = min(cfg.system_prompt_tokens, start + n)
    if start < sys_end:
        shared = np.random.default_rng([cfg.seed, 1 << 30]).integers(0, VOCAB, cfg.system_prompt_tokens)
        ids[: sys_end - start] = shared[start:sys_end]
    lo = max(start, cfg.system_prompt_tokens)
    if lo < start + n:
        own = np.random.default_rng([cfg.seed, session, lo]).integers(0, VOCAB, start + n - lo)
        ids[lo - start :] = own
    return ids
