"""The clients import no daemon code: ``kvstore.client`` and ``kvstore.client.aio`` load no module
of ``kvstore.server`` or ``kvstore.store`` (a client installs and starts without the store's
dependencies: LMDB, zstd, redis, the tiers)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import kvstore.client, kvstore.client.aio
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("kvstore.server", "kvstore.store")))))
"""


def test_clients_import_no_server_or_store_module() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []



RELOAD = """
import importlib, sys
import kvstore.format.chunk as chunk
assert importlib.reload(chunk) is chunk and chunk.__spec__.name == "kvstore.format.chunk"
try:
    import kvstore.chunk  # the 0.1 layout's path: no finder answers for it any more
except ModuleNotFoundError:
    print("gone")
"""


def test_modules_reload_and_old_paths_are_gone() -> None:
    out = subprocess.run([sys.executable, "-c", RELOAD], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "gone"
