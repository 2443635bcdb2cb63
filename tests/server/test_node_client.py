"""What a client in another language sees: a stock Node.js grpc-js client, default channel options.

grpc-js, grpc-go and grpc-java all refuse messages over 4 MiB unless told otherwise, newer tools ask
for reflection v1, and everyone expects the standard health service. The Node client
(tests/node/client.js) checks health, lists services through reflection v1 and v1alpha, reads the
server info and streams a > 8 MiB session with LoadSession; this test compares what it got with
what was saved, byte for byte.

Needs `node` and the packages of tests/node (`scripts/install.sh --dev` runs `npm ci` there when
node is on PATH). Skipped without them, unless KVSTORE_REQUIRE_NODE=1 (CI sets it), where a missing
Node install fails the test instead of hiding it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.client import Client, ClientConfig
from kvstore.format.layout import get_layout
from tests.helpers.daemon import make_session, running_daemon, save_session

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
SERVICE = "kvstore.v1.KVStore"
GRPC_DEFAULT_RECEIVE = 4 << 20


def _node() -> str:
    node = shutil.which("node")
    ready = node is not None and (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir()
    if not ready:
        if os.environ.get("KVSTORE_REQUIRE_NODE") == "1":
            pytest.fail("KVSTORE_REQUIRE_NODE=1 but node or tests/node/node_modules is missing "
                        "(run scripts/install.sh --dev with node on PATH)")
        pytest.skip("node or tests/node/node_modules missing (scripts/install.sh --dev installs them)")
    return node  # type: ignore[return-value]


def test_stock_grpc_js_client_checks_health_reflects_and_streams_a_large_session(tmp_path: Path) -> None:
    node = _node()
    # deepseek-v4.1-flash chunks are 229 KB: 40 of them make a ~9 MB session, over twice the
    # 4 MiB receive limit every stock gRPC channel starts with
    s = make_session("deepseek-v4.1-flash", namespace="polyglot", session_id="node-1",
                     tokens=40 * 256 + 100, quantized=False)
    blobs = b"".join(bytes(b) for b in s.blobs)
    assert len(blobs) > 8 << 20
    with running_daemon(tmp_path / "data") as d:
        with Client(ClientConfig(address=d.address, shared_memory=False)) as c:
            save_session(c, s)
        out = subprocess.run([node, str(NODE_DIR / "client.js"), d.address, s.namespace, s.session_id],
                             capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)

    assert got["health"]["overall"].get("status") == "SERVING", got["health"]
    assert got["health"]["kvstore"].get("status") == "SERVING", got["health"]
    for version in ("reflection_v1", "reflection_v1alpha"):
        assert SERVICE in got[version].get("services", []), (version, got[version])
    info = got["server_info"]
    assert info.get("chunk_tokens") == 256, info
    # what a SaveChunks / Lookup from another language needs: each layout's 16-byte id and geometry
    layouts = {x["name"]: x for x in info["layout_info"]}
    v41 = layouts["deepseek-v4.1-flash"]
    assert bytes(v41["layout_id"]["data"]) == get_layout("deepseek-v4.1-flash").layout_id
    assert v41["bytes_per_token"] == 890 and v41["chunk_bytes"] == len(s.blobs[0]) and len(v41["caches"]) == 8

    load = got["load"]
    assert "error" not in load, load["error"]
    assert load["chunk_keys"] == len(s.blobs)
    assert load["bytes"] == len(blobs)
    assert load["sha256"] == hashlib.sha256(blobs).hexdigest()
    assert load["max_message_bytes"] < GRPC_DEFAULT_RECEIVE - (64 << 10), "messages must fit 4 MiB with margin"
