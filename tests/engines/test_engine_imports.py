"""vLLM is never part of kvstore's own install or of the daemon: the daemon, the clients and the CLI
import nothing of vLLM or of ``kvstore.engines``, and the page geometry imports without vLLM (the
tier module itself is loaded by vLLM, in vLLM's environment: tests/engines/vllm_tier/)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import kvstore.server.daemon, kvstore.server.service, kvstore.client, kvstore.client.aio, cli.main
import kvstore.engines.vllm.geometry
bad = [m for m in sys.modules if m.split(".")[0] == "vllm" or m.startswith("kvstore.engines.vllm.tier")]
print(json.dumps(sorted(bad)))
"""


def test_the_daemon_clients_and_cli_import_nothing_of_vllm() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_nothing_in_kvstore_imports_the_engines_package() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    users = [p for d in ("kvstore", "cli", "replay") for p in (root / d).rglob("*.py")
             if "engines" not in p.parts and "kvstore.engines" in p.read_text()]
    assert users == []
