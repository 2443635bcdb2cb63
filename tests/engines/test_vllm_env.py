"""The vLLM tier's tests (tests/engines/vllm_tier/) in the vLLM environment that scripts/vllm_env.sh builds.

vLLM is never part of kvstore's own install, so its tests run in their own interpreter; this test
runs them there and fails with their output. Without that environment it is skipped, unless
KVSTORE_REQUIRE_VLLM=1 (CI sets it: the tier must be tested against vLLM's real code there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVSTORE_VLLM_VENV", REPO / ".venv-vllm"))


def test_the_vllm_tier_passes_against_vllms_own_offloading_code() -> None:
    python = VENV / "bin" / "python"
    if "vllm" in sys.modules:  # this interpreter is the vLLM one: tests/engines/vllm_tier ran in this session already
        pytest.skip("running inside the vLLM environment")
    if not python.exists():
        if os.environ.get("KVSTORE_REQUIRE_VLLM") == "1":
            pytest.fail(f"no vLLM environment at {VENV}: run scripts/vllm_env.sh")
        pytest.skip(f"no vLLM environment at {VENV} (scripts/vllm_env.sh builds it)")
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "engines" / "vllm_tier")],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
