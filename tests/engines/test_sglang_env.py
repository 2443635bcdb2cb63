"""The HiCache L3 tests (tests/engines/sglang_tier/) in the SGLang environment that scripts/sglang_env.sh builds.

SGLang is never part of kvstore's own install, so its tests run in their own interpreter; this test runs them
there and fails with their output. Without that environment it is skipped, unless KVSTORE_REQUIRE_SGLANG=1 (CI
sets it: the L3 backend must be tested against SGLang's real HiCache code there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVSTORE_SGLANG_VENV", REPO / ".venv-sglang"))


def test_the_hicache_l3_scenarios_pass_against_sglangs_own_hicache_code() -> None:
    python = VENV / "bin" / "python"
    if "sglang" in sys.modules:  # this interpreter is the SGLang one: tests/engines/sglang_tier ran in this session
        pytest.skip("running inside the SGLang environment")
    if not python.exists():
        if os.environ.get("KVSTORE_REQUIRE_SGLANG") == "1":
            pytest.fail(f"no SGLang environment at {VENV}: run scripts/sglang_env.sh")
        pytest.skip(f"no SGLang environment at {VENV} (scripts/sglang_env.sh builds it)")
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "engines" / "sglang_tier")],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
