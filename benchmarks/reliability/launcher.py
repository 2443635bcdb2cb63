"""The reliability harnesses' daemons, through the project's one launcher (``kvstore.server.process``).

``make_spawner("fork")`` is a ``Zygote``: each daemon is forked from a helper process that imported
the daemon once, so a start costs tens of milliseconds (a thousand kill points in minutes);
``make_spawner("exec")`` runs a fresh ``kvstore serve`` interpreter per start (about 2 s here, most
of it importing torch), exactly what an operator runs. Either way the daemon is this tree's code
(run from ``REPO``, without the caller's KVSTORE_* settings) and is killed with a real SIGKILL to a
pid that stays reserved (a zombie) until it is reaped.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path

from benchmarks.reliability.zygote import Zygote
from kvstore.server.process import DaemonProcess, Exec, Spawner, clean_env

REPO = Path(__file__).resolve().parents[2]


def make_spawner(kind: str) -> Spawner:
    """``fork`` (a zygote: ``close()`` it when done) or ``exec``."""
    if kind not in ("fork", "exec"):
        raise ValueError(f"launcher must be fork or exec, got {kind!r}")
    return Zygote(cwd=REPO) if kind == "fork" else Exec()


def daemon(spawner: Spawner, data_dir: Path, flags: Sequence[str], log: Path) -> DaemonProcess:
    """``kvstore serve --port 0 --data-dir DATA_DIR FLAGS`` (``--port N`` in ``flags`` picks the
    port), its stderr appended to ``log``: not started yet (``spawn()`` or ``start()`` it)."""
    return DaemonProcess(data_dir, flags, env=clean_env(), cwd=REPO, spawner=spawner, log_path=log, log_format=None)


def describe_exit(code: int) -> str:
    """A daemon's exit code (negative: the signal that ended it) in words."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
