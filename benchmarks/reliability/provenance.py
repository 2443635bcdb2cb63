"""Which code a reliability run measured: the commit it ran from."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """HEAD of the checkout this runs from ($BENCH_COMMIT where it runs from an exported copy)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
