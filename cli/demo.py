"""`kvstore demo`: the main job, end to end.

Starts a daemon on its embedded default storage (host memory + LMDB in a temporary directory), or
uses ``--address``. Three agents share a system prompt and talk for several turns (real text: the
Python standard library's own sources, byte tokens), saving after every turn. Then every local
state is dropped and the daemon restarted, each session is resumed by SWA Bounded Replay and
decodes on, and one report prints hits by tier, sizes, persistent bytes per token, resume vs
re-prefill time, and fidelity against exact replay.

Needs torch and the trained checkpoint (the ``replay`` extra: ``pip install 'kvstore[replay]'``;
scripts/install.sh installs both).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cli import args as check
from cli.client_cmds import plural
from cli.ui import console, framed, numbers_right
from kvstore.server.process import DaemonProcess, DaemonStartError

if TYPE_CHECKING:
    from kvstore.client import Client
    from replay.model import Transformer

NAMESPACE = "demo"
MAX_FIDELITY_STEPS = 64  # the text kept after each agent's last prompt
INSTALL_REPLAY = "pip install 'kvstore[replay]' (scripts/install.sh installs it: the CPU build of torch on a host " \
                 "without an NVIDIA GPU)"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    positive = check.int_range(1)
    p = sub.add_parser("demo", help="save, evict, restart and resume real agent sessions; print the numbers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", type=check.address, metavar="HOST:PORT",
                   help="use this running daemon instead of starting one")
    p.add_argument("--agents", type=positive, default=3, help="agent sessions (default 3)")
    p.add_argument("--turns", type=positive, default=4, help="turns per agent, each saved (default 4)")
    p.add_argument("--system-tokens", type=check.int_range(0), default=2048,
                   help="shared system prompt length (default 2048)")
    p.add_argument("--turn-tokens", type=positive, default=1536, help="new prompt tokens per turn (default 1536)")
    p.add_argument("--decode-tokens", type=positive, default=16,
                   help="tokens generated per turn and after resume (default 16)")
    p.add_argument("--fidelity-steps", type=check.int_range(1, MAX_FIDELITY_STEPS), default=MAX_FIDELITY_STEPS,
                   help=f"teacher-forced steps compared after resume (1-{MAX_FIDELITY_STEPS}, default "
                        f"{MAX_FIDELITY_STEPS})")
    p.add_argument("--model", choices=["tiny-16", "tiny-8"], default="tiny-16",
                   help="tiny-16 (the trained checkpoint) or tiny-8 (seeded random weights unless --checkpoint)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", metavar="FILE",
                         help="a safetensors checkpoint of --model (default: the trained tiny-16 shipped with kvstore)")
    weights.add_argument("--random-weights", action="store_true", help="seeded random weights instead of a checkpoint")
    p.add_argument("--threads", type=positive, default=1, help="torch CPU threads for the model (default 1)")
    p.set_defaults(func=run)


@contextmanager
def daemon(address: str | None, restart: list[DaemonProcess]) -> Iterator[str]:
    if address:
        yield address
        return
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as d:
        proc = DaemonProcess(d).start()
        restart.append(proc)
        try:
            yield proc.address
        finally:
            restart[-1].stop()


def _model(args: argparse.Namespace) -> tuple[Transformer, str]:
    """The model and a line naming its weights; a usage error for a checkpoint that cannot be used, an
    installation error when the shipped one is missing."""
    from cli.errors import CliError, UsageError
    from replay.model import ModelArgs, Transformer
    from replay.weights import DEFAULT_CHECKPOINT

    margs = ModelArgs.tiny16() if args.model == "tiny-16" else ModelArgs.tiny8()
    if args.random_weights:
        return Transformer(margs, seed=0), "seeded random weights (seed 0, --random-weights)"
    if args.checkpoint is None and args.model != "tiny-16":
        return Transformer(margs, seed=0), f"seeded random weights (seed 0: no trained {args.model} checkpoint ships)"
    path = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    if not path.is_file():
        if args.checkpoint:
            raise UsageError(f"--checkpoint {args.checkpoint}: no such file")
        raise CliError(f"the trained tiny-16 checkpoint is not installed (no {path}): reinstall kvstore "
                       f"({INSTALL_REPLAY}), or run with --random-weights")
    try:
        model = Transformer.load_checkpoint(path)
    except Exception as e:  # safetensors and torch raise many kinds for a file that is not a checkpoint
        why = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(f"--checkpoint {path}: not a kvstore model checkpoint ({why})") from None
    if model.args.layout.name != args.model:
        raise UsageError(f"--checkpoint {path} holds a {model.args.layout.name} model, not --model {args.model}")
    return model, f"trained checkpoint {path.name}"


def continuation(tokens: list[int]) -> str:
    """Byte tokens as text: UTF-8 where it decodes; a byte that does not, a backslash and every
    non-printable character escaped as in a Python string (\\n, \\x00, \\\\)."""
    out = []
    for ch in bytes(tokens).decode("utf-8", errors="surrogateescape"):
        if "\udc80" <= ch <= "\udcff":  # an undecodable byte, as surrogateescape carries it
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch == "\\" or not ch.isprintable():
            out.append(ch.encode("unicode_escape").decode())
        else:
            out.append(ch)
    return "".join(out)


def run(args: argparse.Namespace) -> int:
    from cli.errors import CliError

    try:
        import torch  # the model's imports stay out of every other command's start-up
    except ImportError:
        raise CliError(f"kvstore demo needs torch, which this installation lacks: {INSTALL_REPLAY}") from None
    from kvstore.errors import Unavailable
    from replay.corpus import stdlib_tokens

    con = console()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    model, weights = _model(args)
    try:
        text = stdlib_tokens(args.system_tokens + args.agents * args.turns * (args.turn_tokens + MAX_FIDELITY_STEPS))
    except ValueError as e:  # more text than the standard library holds
        from cli.errors import UsageError

        raise UsageError(f"--system-tokens + --agents x --turns x --turn-tokens: {e}") from None
    lay = model.args.layout
    con.print(f"[bold]kvstore demo[/]: {lay.name} ({float(lay.bytes_per_token):g} B/token persisted), {weights}; "
              f"{plural(args.agents, 'agent')} {'share' if args.agents > 1 else 'with'} a {args.system_tokens:,}-token "
              f"system prompt, "
              f"{plural(args.turns, 'turn')} each")
    procs: list[DaemonProcess] = []
    address = args.address
    try:
        with daemon(args.address, procs) as address:
            _run(con, args, model, text, address, procs)
    except DaemonStartError as e:
        raise CliError(f"the demo's daemon did not start: {e}") from None
    except Unavailable as e:
        why = " ".join(str(e).split()).removeprefix("daemon unavailable: ")
        raise CliError(f"cannot reach kvstore daemon at {address}: {why}") from None
    return 0


def _run(con: Any, args: argparse.Namespace, model: Transformer, text: list[int], address: str,
         procs: list[DaemonProcess]) -> None:
    from kvstore.client import Client
    from replay.fidelity import compare, exact_replay_length, teacher_forced
    from replay.session import AgentSession

    lay = model.args.layout
    system, rest = text[: args.system_tokens], text[args.system_tokens :]
    stride = args.turn_tokens + MAX_FIDELITY_STEPS
    client = Client(address=address)
    sessions: list[AgentSession] = []
    saves: list[list[object]] = []
    cols = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn())
    with Progress(*cols, console=con, transient=True) as prog:
        task = prog.add_task("agents talking (prefill, decode, save)", total=args.agents * args.turns)
        for a in range(args.agents):
            s = AgentSession(model, client, NAMESPACE, f"agent-{a + 1}", {"agent": str(a + 1)})
            sent = new = 0
            t_save = 0.0
            for turn in range(args.turns):
                off = (a * args.turns + turn) * stride
                prompt = (system if turn == 0 else []) + rest[off : off + args.turn_tokens]
                if turn == 0:  # what would a serving engine find cached for this prompt?
                    hit = client.lookup(NAMESPACE, lay.layout_id, prompt)
                logits = s.prefill(prompt)
                s.generate(logits, args.decode_tokens)
                rep = s.save()
                sent, new, t_save = sent + rep.new_chunks, new + rep.written, t_save + rep.seconds
                prog.advance(task)
            sessions.append(s)
            where = ", ".join(f"{k} {v}" for k, v in hit.tiers.items()) or "-"
            saves.append([s.session_id, f"{len(s.tokens):,}", f"{hit.cached_tokens:,}/{hit.requested_tokens:,}",
                          where, sent, new, f"{t_save * 1000:.0f}"])
    t = Table("session", "tokens", "cached", "from", "sent", "new", "save ms", box=box.SIMPLE_HEAD,
              title_justify="left",
              title=f"1. sessions, saved after each of {plural(args.turns, 'turn')} (a shared system prompt's "
                    f"chunks are stored once)",
              caption="cached: tokens of the first prompt the daemon already held (lookup before turn 1); sent: "
                      "chunks sent over all turns; new: chunks the daemon did not hold yet", caption_justify="left")
    for row in saves:
        t.add_row(*map(str, row))
    con.print(framed(numbers_right(t)))

    # 2. evict everything from memory and restart the daemon
    reference = {s.session_id: s for s in sessions}

    def probe(a: int) -> list[int]:  # the text after the agent's last prompt (the gap its replies stood in)
        off = (a * args.turns + args.turns - 1) * stride + args.turn_tokens
        return rest[off : off + args.fidelity_steps]

    probes = {sid: probe(i) for i, sid in enumerate(reference)}
    ref_logits = {}
    exact = {}  # per session: the fewest replayed tokens that rebuild its state bit for bit
    for sid, s in reference.items():  # the never-evicted continuation, for fidelity
        ref_logits[sid] = teacher_forced(model, s.state, s.last_logits, probes[sid])  # type: ignore[arg-type]
        exact[sid] = exact_replay_length(len(s.tokens), s.state.decoder_from, model.args)  # type: ignore[union-attr]
        s.drop()
    client.evict(NAMESPACE, sessions[0].session_id, "ssd")
    if procs:
        procs[-1].stop()
        procs.append(DaemonProcess(procs[-1].data_dir).start())
        client.close()
        client = Client(address=procs[-1].address)
        con.print(f"2. dropped all local state; daemon restarted on the same data dir ({procs[-1].address}): "
                  f"its memory tier is empty")
    else:
        con.print("2. dropped all local state (external daemon: not restarted; agent-1 evicted to ssd)")

    # 3. resume every session by bounded replay and continue decoding
    t = Table("session", "mode", "fetch", "install", "replay", "total", "replayed", box=box.SIMPLE_HEAD,
              title="3. resume and continue decoding (times in ms; replayed: tokens run through the model)",
              title_justify="left")
    fid = Table("session", "mode", "mean KL", "max KL", "top-1", "max |logit err|", box=box.SIMPLE_HEAD,
                title_justify="left",
                title=f"4. fidelity over {args.fidelity_steps} teacher-forced steps vs the never-evicted session")
    timing: dict[str, float] = {}
    continues: list[str] = []
    for i, s in enumerate(sessions):
        modes = ("bounded", "exact", "reprefill") if i == 0 else ("bounded",)
        for mode in modes:
            kw = {"replay_tokens": exact[s.session_id]} if mode == "exact" else {}
            r, rep = AgentSession.resume(model, client, NAMESPACE, s.session_id, mode, **kw)  # type: ignore[arg-type]
            timing[f"{i}:{mode}"] = rep.total_s
            got = teacher_forced(model, r.state, r.last_logits, probes[s.session_id])  # type: ignore[arg-type]
            f = compare(ref_logits[s.session_id], got, rep.replayed)
            fid.add_row(s.session_id, mode, f"{f.mean_kl:.2e}", f"{f.max_kl:.2e}", f"{f.top1_agreement:.0%}",
                        f"{f.max_abs_logit_err:.2e}")
            if mode == "bounded":
                r2, _ = AgentSession.resume(model, client, NAMESPACE, s.session_id, "bounded")
                out = r2.generate(r2.last_logits, args.decode_tokens)
                continues.append(f"   {s.session_id}: [italic]{escape(continuation(out))}[/]")
            t.add_row(s.session_id, mode, f"{rep.fetch_s * 1e3:.0f}", f"{rep.install_s * 1e3:.0f}",
                      f"{rep.replay_s * 1e3:.0f}", f"{rep.total_s * 1e3:.0f}", f"{rep.replayed:,}")
    con.print(framed(numbers_right(t, 2)))
    speed = timing["0:reprefill"] / timing["0:bounded"]
    con.print(f"   bounded resume is [bold]{speed:.1f}x[/] faster than re-prefill "
              f"({timing['0:bounded'] * 1e3:.0f} ms vs {timing['0:reprefill'] * 1e3:.0f} ms, "
              f"{len(sessions[0].tokens):,} tokens)")
    con.print(f"   each continues, after its bounded resume, with ({args.decode_tokens} byte tokens as text):")
    for line in continues:
        con.print(line)
    first = sessions[0].session_id
    con.print(f"   exact replay: the fewest tokens that rebuild the never-evicted state bit for bit, the decoder's "
              f"run plus the encoder layers' receptive field below it ({exact[first]:,} for {first}; "
              f"replay.fidelity.exact_replay_length); bounded replay: the last {model.args.window} tokens.")
    con.print(framed(numbers_right(fid, 2)))
    if model.calibration is not None:
        con.print("   exact replay's error is zero; a re-prefill's is not quite, since it runs the decoder over the "
                  "last 128 tokens only and these sessions decoded. On these trained weights bounded replay's "
                  "error is small but not zero (benchmarks/results/fidelity.md: held-out sessions, error vs "
                  "replay length); a handful of steps is noisy, the calibrated columns below come from "
                  f"{model.calibration.resumes} held-out resumes.")
        _tradeoff(con, model, client, first, ref_logits[first], probes[first], exact[first])
    else:
        why = "--random-weights" if args.random_weights else f"no trained {args.model} checkpoint"
        con.print(f"   exact replay's error is zero. These are seeded random weights ({why}): their near-uniform "
                  "attention makes bounded replay lose far more than a trained model does (the trained tiny-16: "
                  "`kvstore demo` with no weight flags; benchmarks/results/fidelity.md).")
    _store_report(con, client, restarted=bool(procs))
    client.close()


def _tradeoff(con: Any, model: Transformer, client: Client, session_id: str, ref: object, probe: list[int],
              exact: int) -> None:
    """Replay length vs resume time vs error: measured on this session and as the checkpoint calibrated it."""
    from replay.fidelity import compare, teacher_forced
    from replay.session import AgentSession

    cal = model.calibration
    assert cal is not None
    t = Table("replay R", "ms", "KL here", "top-1 here", "calib. KL", "calib. max KL", box=box.SIMPLE_HEAD,
              title_justify="left", title=f"4b. replay length trade-off, {session_id}",
              caption=f"here: this session (mean KL, top-1 agreement); calib.: the checkpoint's calibration, "
                      f"{cal.resumes} held-out resumes of {cal.history:,} tokens (mean and max KL)",
              caption_justify="left")
    runs: list[tuple[str, dict[str, object]]] = [(str(r), {"replay_tokens": r}) for r in (32, 64, 128, 256, 512)]
    runs.append(("max_kl=1e-4", {"max_kl": 1e-4}))
    runs.append(("exact", {"mode": "exact", "replay_tokens": exact}))
    for label, kw in runs:
        r, rep = AgentSession.resume(model, client, NAMESPACE, session_id, **kw)  # type: ignore[arg-type]
        f = compare(ref, teacher_forced(model, r.state, r.last_logits, probe), rep.replayed)  # type: ignore[arg-type]
        exp = "-" if rep.expected_mean_kl is None else f"{rep.expected_mean_kl:.1e}"
        mx = "-" if rep.expected_max_kl is None else f"{rep.expected_max_kl:.1e}"
        name = label if label.isdigit() else f"{rep.replayed:,} ({label})"
        t.add_row(name, f"{rep.replay_s * 1e3:.0f}", f"{f.mean_kl:.1e}", f"{f.top1_agreement:.0%}", exp, mx)
    con.print(framed(numbers_right(t)))


def _store_report(con: Any, client: Client, restarted: bool) -> None:
    from cli.client_cmds import bytes_per_token_view, tiers_table

    st = client.stats()
    con.print(framed(tiers_table(st.tiers, st.loaded_chunks + st.missed_chunks,
                                 title="5. store: where the resumed chunks came from (tiers fast to slow)")))
    con.print(bytes_per_token_view(st.bytes_per_token, number="6. "))
    if restarted:
        con.print(f"   since the restart: {st.loaded_chunks:,} chunk reads served, {st.missed_chunks} missed; the "
                  f"first read of each chunk came from the ssd tier and promoted it to host memory")
