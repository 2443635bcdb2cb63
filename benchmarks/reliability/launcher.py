"""Start, SIGKILL and restart real ``kvstore serve`` processes, fast enough for a thousand kills.

Two launchers with one interface:
- ``ExecLauncher`` runs ``kvstore serve`` (the CLI's ``main``) in a fresh interpreter per start
  (about 2 s here, most of it importing torch), exactly what an operator runs;
- ``ForkLauncher`` keeps one helper process (a "zygote", started once with ``python -c``) that has
  imported the CLI, the daemon, its tiers and torch, and forks it for each start: the child is a
  real daemon process (its own LMDB environment, gRPC server and port, running ``kvstore serve``'s
  ``main``), which starts in tens of milliseconds. The zygote never creates a gRPC object, so
  forking it is safe; the harness, which does, never forks.

Either way a daemon is killed with a real SIGKILL to its pid; the pid stays reserved (a zombie)
until the launcher reaps it, so a kill can never hit a recycled pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parents[2]
READY = "kvstore serving on "
ZYGOTE = f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.reliability import zygote; zygote.main()"


class Launcher(Protocol):
    def spawn(self, argv: list[str], out: Path, err: Path) -> int:
        """Start ``kvstore <argv>`` with stdout to ``out`` and stderr appended to ``err``; its pid."""
        ...

    def reap(self, pid: int) -> int:
        """Wait for ``pid`` (already dead or killed) and return its wait status."""
        ...

    def close(self) -> None: ...


class ExecLauncher:
    """A fresh ``kvstore serve`` interpreter per start."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, argv: list[str], out: Path, err: Path) -> int:
        # The console script would import the installed (editable) checkout; `-c` from REPO imports
        # this tree's code, so an exported copy of a commit runs that commit's daemon.
        cmd = [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main(sys.argv[1:]))"]
        with open(out, "wb") as fo, open(err, "ab") as fe:
            proc = subprocess.Popen([*cmd, *argv], cwd=REPO, env=_env(), stdin=subprocess.DEVNULL, stdout=fo,
                                    stderr=fe)
        self._procs[proc.pid] = proc
        return proc.pid

    def reap(self, pid: int) -> int:
        proc = self._procs.pop(pid)
        proc.wait()
        rc = proc.returncode
        return (-rc) & 0x7F if rc < 0 else (rc & 0xFF) << 8  # back to a wait status

    def close(self) -> None:
        for pid in list(self._procs):
            _kill(pid)
            self.reap(pid)


class ForkLauncher:
    """Forks daemons from a zygote that imported everything once (see the module docstring)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, env=_env(), text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self._reply() != "ready":
            raise RuntimeError("the zygote did not start")

    def _reply(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the zygote exited with {self._proc.wait()}")
        return line

    def _ask(self, command: dict[str, object]) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def spawn(self, argv: list[str], out: Path, err: Path) -> int:
        return int(self._ask({"cmd": "spawn", "argv": argv, "out": str(out), "err": str(err)}))

    def reap(self, pid: int) -> int:
        return int(self._ask({"cmd": "reap", "pid": pid}))

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def make_launcher(kind: str) -> Launcher:
    if kind not in ("fork", "exec"):
        raise ValueError(f"launcher must be fork or exec, got {kind!r}")
    return ForkLauncher() if kind == "fork" else ExecLauncher()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def is_zombie_or_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (it stays a zombie until reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@dataclass
class DaemonHandle:
    """One daemon start: its pid, where its stdout goes, and (once ready) its address."""

    pid: int
    out: Path
    started: float  # time.monotonic() at spawn
    address: str = ""

    def poll_ready(self) -> bool:
        if not self.address:
            text = self.out.read_text(errors="replace") if self.out.exists() else ""
            if READY in text:
                self.address = text.split(READY, 1)[1].split()[0]
        return bool(self.address)

    def wait_ready(self, timeout_s: float) -> bool:
        """Poll until the daemon prints its address (True), exits or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.poll_ready():
            if is_zombie_or_gone(self.pid) or time.monotonic() > deadline:
                return self.poll_ready()
            time.sleep(0.002)
        return True

    def kill(self) -> None:
        _kill(self.pid)


def start(launcher: Launcher, argv: list[str], out: Path, err: Path) -> DaemonHandle:
    """Spawn a daemon whose readiness line will be the only thing in ``out``."""
    out.unlink(missing_ok=True)
    t = time.monotonic()
    return DaemonHandle(launcher.spawn(argv, out, err), out, t)


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"
