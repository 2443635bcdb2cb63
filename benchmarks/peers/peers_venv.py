"""LMCache's own install, in a virtual environment of its own (benchmarks/.peers-venv, git-ignored).

Why a separate venv: LMCache pins its own dependency versions (numpy <= 2.2.6, protobuf 6,
transformers >= 5.4, ...), which must not move kvstore's. torch goes in first, pinned to the CPU
wheel, so pip never pulls a multi-GB CUDA build; then LMCache itself at a pinned version without
dependencies, then its declared dependencies less the three CUDA-only ones (cupy-cuda13x,
cuda-python, cufile-python: they have no use on a host without an NVIDIA GPU, and LMCache's server
and its ``lm://`` client import without them). Every step's command and, if it failed, its error
are kept for the results, so a failed install is reported, never hidden.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

LMCACHE_VERSION = "0.5.6"
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# lmcache 0.5.6's Requires-Dist (no extras), less torch (above) and the CUDA-only packages
DEPS = ("aiofile", "aiofiles", "blake3", "aiohttp", "awscrt", "cryptography", "fastapi", "httpx",
        "huggingface_hub>=1.5.0", "msgspec", "numpy<=2.2.6", "numba", "nvtx", "opentelemetry-api<=1.40.0,>=1.20.0",
        "opentelemetry-sdk>=1.20.0", "opentelemetry-exporter-otlp>=1.20.0",
        "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0", "prometheus_client<=0.24.1,>=0.18.0", "psutil",
        "py-cpuinfo", "pytest", "pyyaml", "pyzmq>=25.0.0", "grpcio>=1.78.0", "grpcio-observability==1.78.0",
        "protobuf<7,>=6.31.1", "redis", "safetensors", "setuptools<81.0.0,>=77.0.3", "setuptools_scm>=8",
        "sortedcontainers", "transformers>=5.4", "uvicorn", "httptools", "cachetools", "google-api-core",
        "google-cloud-bigtable")
SKIPPED = ("cupy-cuda13x", "cuda-python<14,>=13", "cufile-python")
PROBE = ("import lmcache, torch, lmcache.v1.server.__main__, lmcache.v1.storage_backend.connector.lm_connector; "
         "print(lmcache.__version__, torch.__version__)")


@dataclass(frozen=True)
class PeersEnv:
    """The venv's interpreter (None when LMCache could not be installed or imported), the versions
    it reports, and each install step (command, and its error when it failed)."""

    python: Path | None
    lmcache: str = ""
    torch: str = ""
    steps: list[str] = field(default_factory=list)
    error: str = ""


def _run(cmd: list[str], steps: list[str], timeout_s: float = 900) -> bool:
    steps.append(" ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        steps.append(f"  failed: {type(e).__name__}: {e}")
        return False
    if r.returncode != 0:
        tail = [ln for ln in (r.stderr or r.stdout).splitlines() if "WARNING: Location" not in ln][-6:]
        steps.append(f"  failed (exit {r.returncode}): " + " | ".join(tail))
    return r.returncode == 0


def probe(python: Path) -> tuple[str, str] | str:
    """(lmcache version, torch version) as the venv imports them, or the import's error."""
    r = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LMCACHE_LOG_LEVEL": "ERROR"})
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    lmc, torch = r.stdout.split()[-2:]
    return lmc, torch


def recipe(venv: str = "benchmarks/.peers-venv") -> list[str]:
    """The install steps ``ensure`` runs, as commands (for the report)."""
    pip = f"{venv}/bin/python -m pip install -q"
    return [f"python -m venv {venv}", f"{pip} {TORCH}    # else: {pip} --index-url {TORCH_CPU_INDEX} {TORCH}",
            f"{pip} --no-deps lmcache=={LMCACHE_VERSION}",
            f"{pip} <lmcache's {len(DEPS)} declared dependencies (peers_venv.DEPS)> {TORCH}"
            f"    # not: {', '.join(SKIPPED)}"]


def ensure(venv: Path) -> PeersEnv:
    """The peers venv with LMCache ``LMCACHE_VERSION`` in it, installed on first use."""
    python, steps = venv / "bin" / "python", []
    if python.exists():
        got = probe(python)
        if isinstance(got, tuple) and got[0] == LMCACHE_VERSION:
            return PeersEnv(python, *got, ["(already installed in " + str(venv) + ")"])
    if not python.exists() and not _run([sys.executable, "-m", "venv", str(venv)], steps):
        return PeersEnv(None, steps=steps, error="could not create the venv")
    pip = [str(python), "-m", "pip", "install", "-q"]
    if not _run([*pip, TORCH], steps) and not _run([*pip, "--index-url", TORCH_CPU_INDEX, TORCH], steps):
        return PeersEnv(None, steps=steps, error="torch (CPU wheel) could not be installed")
    if not _run([*pip, "--no-deps", f"lmcache=={LMCACHE_VERSION}"], steps):
        return PeersEnv(None, steps=steps, error="lmcache could not be installed")
    if not _run([*pip, *DEPS, TORCH], steps):  # torch again: no dependency may move it
        return PeersEnv(None, steps=steps, error="lmcache's dependencies could not be installed")
    steps.append("not installed (CUDA-only): " + ", ".join(SKIPPED))
    got = probe(python)
    if isinstance(got, str):
        return PeersEnv(None, steps=steps, error=f"import failed: {got}")
    return PeersEnv(python, *got, steps)
