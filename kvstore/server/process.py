"""Run the daemon as a child process (the demo, benchmarks and tests use this)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

_READY = re.compile(r"kvstore serving on (\S+):(\d+)")


class DaemonStartError(RuntimeError):
    """The daemon exited or did not say it was ready in time; the message is its one-line reason (the
    ``kvstore: error:`` line it printed) when it gave one, else the end of its log."""


class DaemonProcess:
    """``with DaemonProcess(data_dir) as d: Client(address=d.address)``. Stopped with SIGTERM
    (graceful: in-flight RPCs finish, LMDB is closed), or SIGKILL with ``kill()``."""

    def __init__(self, data_dir: str | Path, args: Sequence[str] = (), start_timeout_s: float = 60.0) -> None:
        self.data_dir = str(data_dir)
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.log: list[str] = []

    def start(self) -> DaemonProcess:
        cmd = [sys.executable, "-m", "cli.main", "serve", "--port", "0", "--data-dir", self.data_dir,
               "--log-format", "text", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        errors = threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True)
        errors.start()
        found: list[str] = []

        def read_ready() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                m = _READY.search(line)
                if m:
                    found.append(f"{m.group(1)}:{m.group(2)}")
                    break

        t = threading.Thread(target=read_ready, daemon=True)
        t.start()
        t.join(self.start_timeout_s)
        if not found:
            self.kill()
            errors.join(5.0)  # what it printed before it exited
            lines = [line.strip().removeprefix("kvstore: error: ") for line in self.log
                     if line.startswith("kvstore: error: ")]
            raise DaemonStartError(lines[-1] if lines else "kvstore daemon did not start:\n" +
                                   "".join(self.log[-20:]))
        self.address = found[0]
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
        return self

    def _drain(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.log.append(line)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
