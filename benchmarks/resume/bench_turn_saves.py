"""Turn saves at the real geometry (issue 30): what a turn costs at 128K and at 1M tokens, beside a raw
LMDB put + fsync of the same bytes, for a token session and for an engine page session.

    python benchmarks/resume/bench_turn_saves.py [--short 131072] [--long 1048576] [--window 32]
                                                 [--gaps-ms 50 0] [--rest-s 5] [--quick] [--work DIR]
                                                 [--write]

Per session kind, one daemon of default settings on a temp data dir (the benchmark's own file system,
not tmpfs) and one raw LMDB environment opened as the ssd tier opens its own (geometry_raw.RawLmdb):
- token sessions (deepseek-v4.1-flash chunks of 256 tokens: ``Client.save_session``, 8 new chunks per
  2,048-token turn, sent as an append) and engine page sessions (vLLM's V4.1 page layout:
  ``PageSessions.save`` through ``Client.save_pages``, 16 pages per turn read from the engine's slots:
  geometry_pages.py);
- two sessions of the kind: a long one grown to ``--long`` tokens less half the window, then a short
  one to ``--short`` less half the window (every turn saved, and its bytes put raw, as it would be);
- then a window per gap of ``--gaps-ms``: ``--window`` rounds, each one turn of the short session, one
  of the long, and the raw put + fsync'd commit of each turn's bytes, in an order that rotates every
  round (whichever runs second finds caches the first warmed), then the gap. Paced (50 ms: an agent's
  turns are seconds apart, and everything runs cold: caches, the idle core a call wakes) and back to
  back (0: a burst of turns, everything warm). The disks here throttle sustained writes (back to back,
  a 1.8 MB fsync'd write takes 1.1 ms until ~0.3 GB have gone by, then 4.8 ms; 2 s of rest lift the
  throttle), so each window follows ``--rest-s`` of rest, and the raw put of each round is the floor
  its saves are held to. The sessions cross 128K and 1M in the windows' middle.
Both lengths are measured in the same rounds, so the disk's state and the machine's load fall on both
alike: their ratio is the cost of the session's length, and each save's ratio to the raw put of its own
bytes the store's cost over the floor. Medians; the issue's targets, met or not. The long session's
growth (its turns while it was built, back to back) is shown per eighth. ``--quick``: 16K and 32K
tokens, windows of 4 with gaps of 1 and 0 ms (the test's mode). Writes turn_saves.md and .json (benchmarks/out, or
benchmarks/results with --write).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import git_state, machine, markdown_table, targets_table, write_json, write_result
from benchmarks.resume.geometry_pages import BLOCK_TOKENS, PageGrower, RawItems, block_bytes_per_token_block
from benchmarks.resume.geometry_raw import RawLmdb
from benchmarks.resume.geometry_session import CHUNK_TOKENS, LAYOUT, TURN_TOKENS, label, make_session
from kvstore.client import Client
from kvstore.server.process import DaemonProcess

NS = "geometry"
SAVE_TARGET, LENGTH_TARGET = 1.5, 1.10  # turn save / raw put + fsync; at the long length / at the short one
#: A turn of a session: a call that saves it (its seconds) and the raw floor's items (same bytes, same keys).
Prepare = Callable[[str], tuple[Callable[[], float], RawItems]]


@dataclass(frozen=True)
class TurnConfig:
    short: int = 131_072
    long: int = 1_048_576
    window: int = 32  # measured rounds per gap; the sessions cross their lengths in the middle of them all
    gaps_ms: tuple[float, ...] = (50.0, 0.0)  # quiet after each round, one window per gap
    rest_s: float = 5.0  # quiet before each window (the disk's throttle lifts)

    @classmethod
    def quick(cls) -> TurnConfig:
        return cls(short=16_384, long=32_768, window=4, gaps_ms=(1.0, 0.0), rest_s=0.0)

    @property
    def measured(self) -> int:
        """Turns of each session measured, over every window."""
        return self.window * len(self.gaps_ms)

    def built(self, tokens: int) -> int:
        """Turns a session of ``tokens`` tokens is grown by before the windows."""
        return tokens // TURN_TOKENS - self.measured // 2


@dataclass
class KindResult:
    kind: str  # "token" or "page"
    what: str  # one turn, in words
    turn_bytes: int
    seconds: dict[str, list[float]] = field(default_factory=dict)  # {short,long}_{save,raw}@gap, per round
    growth: list[float] = field(default_factory=list)  # the long session's turn saves while it was built
    growth_raw: list[float] = field(default_factory=list)  # ... and the raw puts of their bytes
    notes: list[str] = field(default_factory=list)

    def median(self, metric: str, gap: float) -> float:
        return statistics.median(self.seconds[f"{metric}@{gap:g}"])

    def paired(self, length: str, gap: float) -> float:
        """Median over rounds of (save - raw put of the same turn's bytes) at ``length``."""
        saves, raws = self.seconds[f"{length}_save@{gap:g}"], self.seconds[f"{length}_raw@{gap:g}"]
        return statistics.median(a - b for a, b in zip(saves, raws))

    def ratios(self, cfg: TurnConfig) -> dict[str, dict[str, Any]]:
        out = {}
        for gap in cfg.gaps_ms:
            at = f"{gap:g} ms apart"
            for length in ("short", "long"):
                r = self.median(f"{length}_save", gap) / self.median(f"{length}_raw", gap)
                out[f"{self.kind} session, {at}: turn save / raw put + fsync, at {label(getattr(cfg, length))}"] = {
                    "ratio": r, "target": SAVE_TARGET, "met": r <= SAVE_TARGET}
            r = self.median("long_save", gap) / self.median("short_save", gap)
            out[f"{self.kind} session, {at}: turn save at {label(cfg.long)} / at {label(cfg.short)}"] = {
                "ratio": r, "target": LENGTH_TARGET, "met": r <= LENGTH_TARGET}
        return out


def grow(prepare: Prepare, session_id: str, turns: int, raw: RawLmdb, r: KindResult | None = None) -> None:
    """``turns`` turns of ``session_id``, each saved then its bytes put raw (the raw environment grows
    alongside the daemon's), back to back; with ``r``, the seconds of each kept as its growth."""
    for _ in range(turns):
        save, items = prepare(session_id)
        seconds = save()
        put = raw.put_turn(items)
        if r is not None:
            r.growth.append(seconds)
            r.growth_raw.append(put)


def window(cfg: TurnConfig, gap_ms: float, prepare: Prepare, raw: RawLmdb, r: KindResult) -> None:
    """The measured rounds: a turn of each session and the raw put of each turn's bytes, in rotating
    order, ``gap_ms`` apart."""
    for k in range(cfg.window):
        steps: list[tuple[str, Callable[[], float]]] = []
        for length in ("short", "long"):
            save, items = prepare(length)
            steps += [(f"{length}_save", save), (f"{length}_raw", lambda items=items: raw.put_turn(items))]
        for i in range(len(steps)):
            name, step = steps[(i + k) % len(steps)]  # a raw put may come before its save: the bytes are known
            r.seconds.setdefault(f"{name}@{gap_ms:g}", []).append(step())
        if gap_ms:
            time.sleep(gap_ms / 1e3)


def run_kind(cfg: TurnConfig, work: Path, kind: str) -> KindResult:
    raw = RawLmdb(work / f"raw-{kind}")
    d = DaemonProcess(work / f"daemon-{kind}").start()
    try:
        client = Client(d.address)
        if kind == "token":
            prepare, r, check = _token_sessions(cfg, client)
        else:
            pages = PageGrower(client)
            prepare, check = pages.prepare, pages.check
            r = KindResult("page", "16 pages: 8 blocks x 2 groups, vLLM's save_pages",
                           block_bytes_per_token_block() * TURN_TOKENS // BLOCK_TOKENS)
        grow(prepare, "long", cfg.built(cfg.long), raw, r)
        grow(prepare, "short", cfg.built(cfg.short), raw)
        for gap in cfg.gaps_ms:
            time.sleep(cfg.rest_s)
            window(cfg, gap, prepare, raw, r)
        for sid in ("short", "long"):
            check(sid)
        client.close()
    finally:
        d.stop()
        raw.close()
    return r


def _token_sessions(cfg: TurnConfig, client: Client) -> tuple[Prepare, KindResult, Callable[[str], None]]:
    """Two token sessions long enough for the window past their lengths, turn by turn."""
    extra = (cfg.measured - cfg.measured // 2) * TURN_TOKENS
    sessions = {"short": make_session(cfg.short + extra, NS, seed=1), "long": make_session(cfg.long + extra, NS,
                                                                                             seed=2)}
    turns = {sid: s.turns(sid) for sid, s in sessions.items()}
    done = dict.fromkeys(sessions, 0)
    per = TURN_TOKENS // CHUNK_TOKENS

    def prepare(sid: str) -> tuple[Callable[[], float], RawItems]:
        i = done[sid]
        m, new = turns[sid][i]

        def save() -> float:
            t = time.perf_counter()
            client.save_session(m, new)
            seconds = time.perf_counter() - t
            done[sid] = i + 1
            return seconds

        return save, list(zip(sessions[sid].keys[i * per : (i + 1) * per], map(memoryview, new)))

    def check(sid: str) -> None:
        m, _ = client.get_session(NS, sid)
        if list(m.chunk_keys) != list(sessions[sid].keys[: done[sid] * per]):
            raise RuntimeError(f"token session {sid!r}: the daemon's version names other chunks than were saved")

    nbytes = sum(map(len, turns["short"][0][1]))
    return prepare, KindResult("token", "8 chunks, an append: new keys + tail + last ids", nbytes), check


# -- report ---------------------------------------------------------------------------------------
def report(results: list[KindResult], cfg: TurnConfig, command: str) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    s, lg = label(cfg.short), label(cfg.long)
    gaps = ", ".join(f"{g:g} ms" for g in cfg.gaps_ms)
    lines = [f"`{command}`", "", f"{machine()}; {git_state()}; load average {load} at the end (2 cores, shared); "
             f"layout {LAYOUT}; default daemon and client; windows of {cfg.window} rounds after {cfg.rest_s:g} s of "
             f"rest, the rounds {gaps} apart; medians.", ""]
    targets: dict[str, dict[str, Any]] = {}
    for r in results:
        rows = []
        for gap in cfg.gaps_ms:
            at = f"{gap:g} ms apart"
            lengths = ("short", "long")
            for metric, what in (("save", "turn save, p50"), ("raw", "raw LMDB put + fsync'd commit, p50")):
                rows.append([f"{at}: {what}", *(f"{r.median(f'{n}_{metric}', gap) * 1e3:.2f}" for n in lengths)])
            rows.append([f"{at}: turn save / raw, p50s",
                         *(f"{r.median(f'{n}_save', gap) / r.median(f'{n}_raw', gap):.2f}x" for n in lengths)])
            rows.append([f"{at}: turn save less the raw put of its bytes, paired per round, p50",
                         *(f"{r.paired(n, gap) * 1e3:.2f}" for n in ("short", "long"))])
        mb = r.turn_bytes / 1e6
        lines += [f"## {r.kind.capitalize()} sessions: a turn is {r.what} ({mb:.2f} MB)", "",
                  markdown_table(["ms", f"at {s}", f"at {lg}"], rows), ""]
        if len(r.growth) > 8:  # its first turn connects the client: left out
            rows = []
            for part in np.array_split(np.arange(1, len(r.growth)), 8):
                save = statistics.median(r.growth[i] for i in part)
                put = statistics.median(r.growth_raw[i] for i in part)
                rows.append([f"{label(int(part[0]) * TURN_TOKENS)}-{label((int(part[-1]) + 1) * TURN_TOKENS)}",
                             f"{save * 1e3:.2f}", f"{put * 1e3:.2f}", f"{save / put:.2f}x"])
            lines += [f"The {lg} session while it grew (back to back, each turn's save then the raw put of its bytes), "
                      f"p50 per eighth of its growth:", "",
                      markdown_table(["tokens", "turn save, ms", "raw put + fsync, ms", "ratio"], rows), ""]
        lines += [f"- {n}" for n in r.notes]
        targets.update(r.ratios(cfg))
    lines += ["## Targets", "", targets_table("target", targets)]
    return "\n".join(lines)


def run(cfg: TurnConfig, work: Path) -> list[KindResult]:
    return [run_kind(cfg, work, kind) for kind in ("token", "page")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", type=int, default=TurnConfig.short)
    p.add_argument("--long", type=int, default=TurnConfig.long)
    p.add_argument("--window", type=int, default=TurnConfig.window)
    p.add_argument("--gaps-ms", type=float, nargs="+", default=list(TurnConfig.gaps_ms))
    p.add_argument("--rest-s", type=float, default=TurnConfig.rest_s)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", type=Path, default=None, help="where the data dirs go (default: a temp dir)")
    args = p.parse_args(argv)
    cfg = TurnConfig.quick() if args.quick else TurnConfig(args.short, args.long, args.window,
                                                                          tuple(args.gaps_ms), args.rest_s)
    if cfg.built(cfg.short) < 1 or cfg.short >= cfg.long:
        p.error("--short must exceed half the windows' tokens (windows x window x 1,024) and be below --long")
    command = "python benchmarks/resume/bench_turn_saves.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="turn-saves-", dir=args.work) as tmp:
        results = run(cfg, Path(tmp))
    text = report(results, cfg, command.strip())
    print(text)
    path = write_result("turn_saves.md", "Turn saves at the real geometry (issue 30)", text)
    write_json("turn_saves.json", command.strip(), {"config": asdict(cfg), "kinds": [
        {**asdict(r), "ratios": r.ratios(cfg)} for r in results]})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
