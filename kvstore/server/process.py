"""Run ``kvstore serve`` as a child process: the one daemon launcher of the demo, the benchmarks and the tests.

``with DaemonProcess(data_dir, flags) as d: Client(address=d.address)`` runs ``kvstore serve --port 0
--data-dir DATA_DIR --log-format text FLAGS`` (later flags win, so ``--port N`` in ``flags`` picks
the port) and returns once the daemon printed ``kvstore serving on HOST:PORT``. ``stop()`` is SIGTERM
(graceful: in-flight RPCs finish, LMDB is closed), SIGKILL past a timeout; ``kill()`` is SIGKILL.

A daemon's stdout goes to a file (the readiness line is all it prints) and its stderr is appended to
a log file: by default both in a private temporary directory, removed when the daemon is reaped, or
at ``log_path`` (a test reads the log across restarts). Files, not pipes, so that a daemon forked
from a zygote (benchmarks/reliability/zygote.py: a helper process that imported the daemon once, a
start in tens of milliseconds instead of ~2 s, for the reliability storm's thousand restarts) is
started, watched and killed
exactly like one ``Exec`` runs in a fresh interpreter: the ``spawner`` is the one thing that differs.

Until a daemon is reaped (``wait``, ``stop``, ``kill``) its pid stays reserved (a zombie), so a
signal can never hit a recycled pid; ``exited()`` tells whether it has exited without reaping it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

READY = "kvstore serving on "  # what `kvstore serve` prints on stdout once it accepts calls
_POLL_S = 0.002


def kvstore_command() -> list[str]:
    """How to run ``kvstore`` with this interpreter and the code it imports (``python -m cli.main``)."""
    return [sys.executable, "-m", "cli.main"]


def clean_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) without any KVSTORE_* settings, plus ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("KVSTORE_")}
    env.update(extra)
    return env


def ready_address(stdout: str) -> str:
    """``HOST:PORT`` from a daemon's stdout once it printed its readiness line, else ``""``."""
    return stdout.split(READY, 1)[1].split()[0] if READY in stdout else ""


def exited(pid: int) -> bool:
    """Whether child ``pid`` has exited (a zombie until reaped), without reaping it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


class DaemonStartError(RuntimeError):
    """The daemon exited or did not say it was ready in time; the message is its one-line reason (the
    ``kvstore: error:`` line it printed) when it gave one, else its exit code and the end of its log."""


class Child(Protocol):
    """A started daemon process: the part of ``subprocess.Popen`` the launcher and its users need."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Spawner(Protocol):
    def spawn(self, argv: Sequence[str], out: Path, err: Path, env: Mapping[str, str], cwd: Path | None) -> Child:
        """Start ``kvstore ARGV`` with stdout to ``out`` (truncated) and stderr appended to ``err``."""
        ...

    def close(self) -> None:
        """Release what the spawner holds (not the daemons it started)."""
        ...


class Exec:
    """A fresh interpreter per start: ``command ARGV`` (default ``kvstore_command()``; another
    checkout's or venv's ``kvstore``, or a wrapper such as ``setpriv ... python -m cli.main``)."""

    def __init__(self, command: Sequence[str] | None = None) -> None:
        self.command = list(command) if command is not None else kvstore_command()

    def spawn(self, argv: Sequence[str], out: Path, err: Path, env: Mapping[str, str],
              cwd: Path | None) -> subprocess.Popen[bytes]:
        with open(out, "wb") as fo, open(err, "ab") as fe:
            return subprocess.Popen([*self.command, *argv], cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe)

    def close(self) -> None:
        pass  # nothing held: each start is an interpreter of its own


class DaemonProcess:
    """One daemon start (see the module docstring). ``spawn()`` starts it, ``wait_ready()`` waits for
    its address; ``start()`` does both and raises ``DaemonStartError`` if it does not come up."""

    def __init__(self, data_dir: str | Path, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, spawner: Spawner | None = None, log_path: str | Path | None = None,
                 log_format: str | None = "text", start_timeout_s: float = 60.0) -> None:
        """``env``: the daemon's environment (default: ours); ``log_format``: None for the daemon's own
        default (JSON lines); ``log_path``: its stderr, appended (stdout beside it, ``<name>.out``)."""
        self.data_dir = Path(data_dir)
        self.args = list(args)
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.cwd = Path(cwd) if cwd is not None else None
        self.spawner = spawner or Exec()
        self.log_format = log_format
        self.start_timeout_s = start_timeout_s
        self._private = log_path is None  # then a temporary directory per start, removed when reaped
        self.log_path: Path | None = Path(log_path) if log_path is not None else None  # private: set at spawn
        self.proc: Child | None = None
        self.address = ""
        self.started = 0.0  # time.monotonic() at spawn
        self._log = ""  # the log, once the private directory is gone

    @property
    def out_path(self) -> Path:
        """Where the daemon's stdout goes (its readiness line), beside its log."""
        assert self.log_path is not None, "not spawned"
        return self.log_path.with_name(self.log_path.name + ".out")

    @property
    def argv(self) -> list[str]:
        fmt = ["--log-format", self.log_format] if self.log_format else []
        return ["serve", "--port", "0", "--data-dir", str(self.data_dir), *fmt, *self.args]

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not spawned"
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def spawn(self) -> DaemonProcess:
        """Start the daemon; do not wait for it."""
        if self._private:
            self.log_path = Path(tempfile.mkdtemp(prefix="kvstore-daemon-")) / "daemon.log"
        assert self.log_path is not None
        self.out_path.unlink(missing_ok=True)  # a forked child truncates it only after we look
        self.address = ""
        self.started = time.monotonic()
        self.proc = self.spawner.spawn(self.argv, self.out_path, self.log_path, self.env, self.cwd)
        return self

    def poll_ready(self) -> bool:
        """Whether the daemon has printed its address (then in ``address``)."""
        if not self.address and self.log_path is not None and self.out_path.exists():
            self.address = ready_address(self.out_path.read_text(errors="replace"))
        return bool(self.address)

    def wait_ready(self, timeout_s: float) -> bool:
        """Until the daemon prints its address (True), exits or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.poll_ready():
            if self.exited() or time.monotonic() > deadline:
                return self.poll_ready()
            time.sleep(_POLL_S)
        return True

    def start(self) -> DaemonProcess:
        self.spawn()
        if not self.wait_ready(self.start_timeout_s):
            code = self.kill()
            log = self.log()
            errors = [line.removeprefix("kvstore: error: ").strip() for line in log.splitlines()
                      if line.startswith("kvstore: error: ")]
            raise DaemonStartError(errors[-1] if errors else
                                   f"kvstore daemon did not start within {self.start_timeout_s:g} s (exit code "
                                   f"{code}); its log ends:\n" + "\n".join(log.splitlines()[-20:]))
        return self

    def exited(self) -> bool:
        """Whether the daemon has exited, without reaping it (see the module docstring)."""
        return self.proc is None or self.proc.returncode is not None or exited(self.proc.pid)

    def log(self) -> str:
        """What the daemon wrote to stderr so far (its log lines and errors)."""
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return self._log

    def wait(self, timeout_s: float | None = None) -> int:
        """Reap the daemon (``subprocess.TimeoutExpired`` past ``timeout_s``); its exit code, negative
        for a signal, as ``Popen.returncode``."""
        if self.proc is None:
            return 0
        code = self.proc.wait(timeout_s)
        if self._private and self.log_path is not None and self.log_path.parent.exists():
            self._log = self.log()
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        return code

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL (if it still runs) and reap; the exit code."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        return self.wait()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
