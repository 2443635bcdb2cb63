"""Running an engine's own test folder in the engine's environment (vLLM's, SGLang's: never kvstore's own
install), from the main suite: skipped without that environment unless CI requires it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_engine_tests(engine: str, folder: str, script: str, venv_var: str, default_venv: str,
                     require_var: str) -> None:
    """``tests/engines/<folder>`` run by the ``engine`` environment's interpreter (``$venv_var`` or
    ``default_venv``, built by ``scripts/<script>``); fails with their output. Without that environment the
    calling test skips, unless ``$require_var`` is 1 (CI sets it: the integration must be tested against the
    engine's real code there)."""
    venv = Path(os.environ.get(venv_var, REPO / default_venv))
    python = venv / "bin" / "python"
    if engine.lower() in sys.modules:  # this interpreter is the engine's one: its folder ran in this session
        pytest.skip(f"running inside the {engine} environment")
    if not python.exists():
        if os.environ.get(require_var) == "1":
            pytest.fail(f"no {engine} environment at {venv}: run scripts/{script}")
        pytest.skip(f"no {engine} environment at {venv} (scripts/{script} builds it)")
    # --show-capture=no: a failure's report is its assertion, not the engine's log lines (they fill the tail)
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--show-capture=no",
                        str(REPO / "tests" / "engines" / folder)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
