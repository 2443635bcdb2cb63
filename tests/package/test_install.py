"""What `pip install kvstore` gives (issue 19): a wheel built from this checkout carries the trained
checkpoint and its calibration table, its license is an SPDX expression, and it needs no torch;
installed into an environment without torch, the daemon, the CLI and the client work and
`kvstore demo` says how to install what it needs. Nothing in the daemon, the client or the CLI
imports torch when it loads.

The wheel is built from a copy of the checkout with the test interpreter's own setuptools
(``--no-build-isolation``: no network). The environment without torch is a fresh venv whose
dependencies are this one's site-packages less torch and what only torch uses (symlinked), with
the wheel installed by pip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

from kvstore.client import Client
from tests.helpers.daemon import READY, REPO, START_TIMEOUT_S, clean_env, free_port, make_session

CHECKPOINT = "replay/checkpoints/tiny16-stdlib.safetensors"
CALIBRATION = "replay/checkpoints/tiny16-stdlib.calibration.json"
NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", "node_modules", ".peers-venv", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "kvstore-data",
                                    "*.so")
# torch and what only it, triton or the model use; and this checkout's own editable install
WITHOUT = ("torch", "functorch", "torchgen", "triton", "nvidia", "safetensors", "kvstore", "__editable__",
           "_kvstore")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the wheel built from a copy of this checkout, the build's output)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=NOT_COPIED, symlinks=True)
    out = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (built,) = out.glob("kvstore-*.whl")
    return built, r.stdout + r.stderr


def test_the_wheel_ships_the_checkpoint_and_its_calibration(wheel: tuple[Path, str]) -> None:
    path, _ = wheel
    with zipfile.ZipFile(path) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
        calibration = json.loads(z.read(CALIBRATION))
    for name in (CHECKPOINT, CALIBRATION, "replay/checkpoints/tiny16-stdlib.eval.json", "kvstore/py.typed"):
        assert sizes.get(name) == (REPO / name).stat().st_size, name
    assert calibration == json.loads((REPO / CALIBRATION).read_text())


def test_the_wheel_needs_no_torch_and_names_its_license_once(wheel: tuple[Path, str]) -> None:
    path, build_log = wheel
    with zipfile.ZipFile(path) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(meta).decode())
    requires = metadata.get_all("Requires-Dist") or []
    assert [r for r in requires if r.startswith("torch")] == ['torch>=2.4; extra == "replay"'], requires
    assert "replay" in (metadata.get_all("Provides-Extra") or [])
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "License" not in metadata  # the old free-text field, from the deprecated license table
    assert "project.license" not in build_log and "SetuptoolsDeprecationWarning" not in build_log, build_log[-3000:]


@pytest.fixture(scope="module")
def torchless(wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv without torch holding the wheel: its bin directory."""
    tmp = tmp_path_factory.mktemp("torchless")
    deps = tmp / "deps"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not entry.name.startswith(WITHOUT) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(f"{deps}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                        str(wheel[0])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    probe = subprocess.run([str(py), "-c", "import torch"], capture_output=True, text=True, cwd=tmp)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    return venv / "bin"


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "kvstore"), *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def torchless_daemon(torchless: Path, tmp_path: Path) -> Iterator[str]:
    """`kvstore serve` from the environment without torch; its address."""
    proc = subprocess.Popen([str(torchless / "kvstore"), "serve", "--port", "0", "--data-dir", str(tmp_path / "d"),
                             "--log-format", "text"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(START_TIMEOUT_S) else ""
        assert line.startswith(READY), (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        yield line[len(READY):].strip()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_without_torch_the_daemon_cli_and_client_work(torchless: Path, torchless_daemon: str,
                                                      tmp_path: Path) -> None:
    s = make_session(namespace="plain", session_id="s")  # built here, where torch is: the bytes are what count
    with Client(address=torchless_daemon, shared_memory=False) as c:
        c.save_session(s.manifest, s.blobs)
        _, chunks = c.load_session("plain", "s")
        assert [bytes(b) for _, b in chunks] == s.blobs
    health = _run(torchless, "health", "--address", torchless_daemon, cwd=tmp_path)
    assert (health.returncode, health.stdout) == (0, "SERVING\n"), health.stderr
    ls = _run(torchless, "sessions", "ls", "--address", torchless_daemon, cwd=tmp_path)
    assert ls.returncode == 0 and "plain" in ls.stdout, ls.stderr
    probe = subprocess.run([str(torchless / "python"), "-c", "import kvstore.client, kvstore.client.aio, "
                            "kvstore.server.daemon; import sys; print('torch' in sys.modules)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_without_torch_the_demo_says_how_to_install_it(torchless: Path, tmp_path: Path) -> None:
    r = _run(torchless, "demo", "--address", f"127.0.0.1:{free_port()}", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr == ("kvstore: error: kvstore demo needs torch, which this installation lacks: pip install "
                        "'kvstore[replay]' (scripts/install.sh installs it: the CPU build of torch on a host without "
                        "an NVIDIA GPU)\n")


PROBE = """
import json, pkgutil, sys, importlib
import cli, kvstore.server
names = ["kvstore.client", "kvstore.client.aio"]
names += ["kvstore.server." + m.name for m in pkgutil.iter_modules(kvstore.server.__path__)]
names += ["cli." + m.name for m in pkgutil.iter_modules(cli.__path__)]
for name in names:
    importlib.import_module(name)
from cli.main import build_parser
build_parser()  # every command registered, the demo's too
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "safetensors"))))
"""


def test_the_daemon_client_and_cli_modules_import_no_torch() -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
