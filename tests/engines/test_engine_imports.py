"""vLLM and SGLang are never part of kvstore's own install or of the daemon: the daemon, the clients and
the CLI import nothing of vLLM, SGLang or ``kvstore.engines``, and the page geometries and the shared
page sessions import without either (the tier and the backend are loaded by their engine, in its
environment: tests/engines/vllm_tier/, tests/engines/sglang_tier/)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import kvstore.server.daemon, kvstore.server.service, kvstore.client, kvstore.client.aio, cli.main
import kvstore.engines.vllm.geometry, kvstore.engines.sglang.geometry, kvstore.engines.pages.sessions
import kvstore.engines.pages.daemon
bad = [m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang")
       or m.startswith(("kvstore.engines.vllm.tier", "kvstore.engines.sglang.backend"))]
print(json.dumps(sorted(bad)))
"""


def test_the_daemon_clients_and_cli_import_nothing_of_vllm_or_sglang() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_nothing_in_kvstore_imports_the_engines_package() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    users = [p for d in ("kvstore", "cli", "replay") for p in (root / d).rglob("*.py")
             if "engines" not in p.parts and "kvstore.engines" in p.read_text()]
    assert users == []
