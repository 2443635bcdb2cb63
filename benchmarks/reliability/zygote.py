"""A zygote: daemons forked from a helper process that imported them once, for the reliability studies.

A daemon started fresh spends most of a second importing (torch, lmdb, the CLI); a study that kills
and restarts one a thousand times forks it from here instead (``Zygote`` is a ``Spawner`` of
kvstore/server/process.py's ``DaemonProcess``): the child is a real daemon process, its own LMDB
environment, gRPC server and port, running ``kvstore serve``'s ``main``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstore.server.process import Child, clean_env, exited

_POLL_S = 0.002

class Zygote:
    """Spawns daemons by forking a helper process (``python -c``, started once) that imported the
    CLI, the daemon, its tiers and torch: the child is a real daemon process (its own LMDB
    environment, gRPC server and port, running ``kvstore serve``'s ``main``) that starts in tens of
    milliseconds. The helper never creates a gRPC object, so forking it is safe; a process that
    does (the caller) never forks. ``close()`` when done."""

    def __init__(self, cwd: str | Path | None = None, env: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()  # one request and its answer at a time on the helper's pipes
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from benchmarks.reliability.zygote import zygote_main; zygote_main()"],
            cwd=cwd, env=clean_env(env), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self._ask(None) != "ready":
            raise RuntimeError("the zygote did not start")

    def _ask(self, command: dict[str, object] | None) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            if command is not None:
                self._proc.stdin.write(json.dumps(command) + "\n")
                self._proc.stdin.flush()
            line = self._proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the zygote exited with {self._proc.wait()}")
        return line

    def spawn(self, argv: Sequence[str], out: Path, err: Path, env: Mapping[str, str], cwd: Path | None) -> Child:
        pid = int(self._ask({"cmd": "spawn", "argv": list(argv), "out": str(out), "err": str(err), "env": dict(env),
                             "cwd": str(cwd) if cwd is not None else None}))
        return _Forked(pid, self)

    def reap(self, pid: int) -> int:
        """Wait for ``pid`` (already dead or killed); its wait status."""
        return int(self._ask({"cmd": "reap", "pid": pid}))

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class _Forked:
    """A zygote's child, with ``Popen``'s manners: reaped (through the zygote) by ``wait``/``poll``."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None and exited(self.pid):
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not exited(self.pid):  # the zygote's waitpid would block its other answers
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(f"kvstore daemon {self.pid}", timeout or 0.0)
                time.sleep(_POLL_S)
            self.returncode = os.waitstatus_to_exitcode(self._zygote.reap(self.pid))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped: the pid is still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# everything `kvstore serve` imports on its way to serving, so that a forked child skips it
_PRELOAD = ("lmdb", "torch", "zstandard", "cli.main", "cli.serve_cmd", "kvstore.server.daemon",
            "kvstore.tiers.host.tier", "kvstore.tiers.ssd.tier")


def zygote_main() -> None:
    """The zygote's loop: one JSON command per line on stdin, one answer line on stdout.
    ``{"cmd": "spawn", "argv", "out", "err", "env", "cwd"}`` -> the child's pid; ``{"cmd": "reap",
    "pid"}`` -> its wait status. Single-threaded and gRPC-object-free: it only imports, then forks."""
    for name in _PRELOAD:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _zygote_child(command)
            print(pid, flush=True)
        elif command["cmd"] == "reap":
            print(os.waitpid(int(command["pid"]), 0)[1], flush=True)


def _zygote_child(command: dict[str, object]) -> None:
    """In the forked child: redirect, take the daemon's environment, run ``kvstore``'s ``main``; never return."""
    code = 1
    try:
        fo = os.open(str(command["out"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fe = os.open(str(command["err"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (fo, 1), (fe, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0)  # noqa: SIM115 - the child's own, for the rest of its life
        os.environ.clear()
        os.environ.update(command["env"])  # type: ignore[call-overload]
        if command["cwd"] is not None:
            os.chdir(str(command["cwd"]))
        code = importlib.import_module("cli.main").main(list(command["argv"])) or 0  # type: ignore[call-overload]
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
