"""How many of kvstore's files one same-host save and one whole-session load pass through, counted as they run.

    python benchmarks/daemon/files_crossed.py [--write]

A daemon (default config: host memory over LMDB, a temp data dir) runs in this process beside a
``Client``, which finds its local socket as any same-host client does. Every thread's Python calls
are profiled (``sys.setprofile``/``threading.setprofile``) while one call runs: a durable turn save
(``Client.save_session``, after a first turn, so it is the steady state of a session), a load into
the caller's memory (``load_session_into``), and the default ``load_session()``. The table names,
for each, how many files of ``kvstore/`` had a function called (package ``__init__`` files and the
generated ``kvstore/v1/`` counted apart) and lists them; the issue's targets are a save through at
most 28 files and a load through at most 25. Writes ``files_crossed.{md,json}`` (under ``results/``
with ``--write``, else ``out/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, machine, markdown_table, write_result  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.server.config import load_config  # noqa: E402
from kvstore.server.daemon import serve  # noqa: E402
from tests.helpers.daemon import SyntheticSession, make_session  # noqa: E402

PKG = ROOT / "kvstore"
LAYOUT = "deepseek-v4.1-flash"
CHUNK_TOKENS = 256
NAMESPACE, SESSION = "files", "crossed"


class Crossings:
    """The ``kvstore/`` files whose functions ran while ``recording``, in the order first seen."""

    def __init__(self) -> None:
        self.recording = False
        self.seen: dict[str, None] = {}
        self._lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if self.recording and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(PKG)) and name not in self.seen:
                with self._lock:
                    self.seen.setdefault(name, None)

    @contextmanager
    def of(self) -> Iterator[list[str]]:
        self.seen = {}
        out: list[str] = []
        self.recording = True
        try:
            yield out
        finally:
            self.recording = False
            out.extend(str(Path(f).relative_to(ROOT)) for f in self.seen)


def session_turns() -> tuple[SyntheticSession, SyntheticSession]:
    """A session's first turn (4 chunks of the real geometry) and its second (4 more, the same first 4)."""
    ids = np.random.default_rng(0).integers(0, 50_000, 8 * CHUNK_TOKENS + 10)
    return tuple(make_session(LAYOUT, NAMESPACE, SESSION, n * CHUNK_TOKENS + 10, CHUNK_TOKENS,
                              token_ids=ids[: n * CHUNK_TOKENS + 10]) for n in (4, 8))  # type: ignore[return-value]


def count(files: list[str]) -> dict[str, Any]:
    face = [f for f in files if f.endswith("__init__.py")]
    generated = [f for f in files if f.startswith("kvstore/v1/")]
    own = [f for f in files if f not in face and f not in generated]
    return {"files": len(own), "package_faces": len(face), "generated": len(generated), "list": own}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --write: benchmarks/common.py
    cross = Crossings()
    threading.setprofile(cross.profile)
    sys.setprofile(cross.profile)
    ready = threading.Event()
    port: list[int] = []
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-files-") as tmp:
        config = load_config(env={}, overrides={"data_dir": tmp, "port": 0})

        def on_ready(p: int) -> None:
            port.append(p)
            ready.set()

        def drive() -> None:
            try:
                if not ready.wait(60):
                    return
                first, second = session_turns()
                with Client(f"127.0.0.1:{port[0]}") as c:
                    c.save_session(first.manifest, first.blobs)
                    out = bytearray(sum(len(b) for b in second.blobs))
                    steps: list[tuple[str, Callable[[], object]]] = [
                        ("a durable turn save (save_session)",
                         lambda: c.save_session(second.manifest, second.blobs[4:])),
                        ("a load into the caller's memory (load_session_into)",
                         lambda: c.load_session_into(NAMESPACE, SESSION, out)),
                        ("the default load (load_session)", lambda: list(c.load_session(NAMESPACE, SESSION)[1])),
                    ]
                    c.load_session(NAMESPACE, SESSION)  # warm: the first load attaches what it needs
                    for what, call in steps:
                        with cross.of() as files:
                            call()
                        results[what] = count(files)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # the daemon shuts down as on any SIGTERM

        driver = threading.Thread(target=drive)
        driver.start()
        asyncio.run(serve(config, on_ready))  # the main thread's: the daemon installs its signal handlers
        driver.join()
    if len(results) < 3:
        raise SystemExit("the daemon did not start, or a call failed")
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    rows = [[what, r["files"], r["package_faces"], r["generated"]] for what, r in results.items()]
    table = markdown_table(["call (same host)", "kvstore files", "package faces", "generated (v1)"], rows)
    print(table)
    for what, r in results.items():
        print(f"\n{what}: {', '.join(r['list'])}")
    lists = "\n".join(f"- {what}: " + ", ".join(f"`{f}`" for f in r["list"]) for what, r in results.items())
    (RESULTS / "files_crossed.json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    write_result("files_crossed.md", "Files one call crosses",
                 f"`python benchmarks/daemon/files_crossed.py --write`: the files of `kvstore/` whose functions ran "
                 f"during one call, client and daemon together.\n\n{table}\n\n{lists}\n")


if __name__ == "__main__":
    main()
