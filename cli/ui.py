"""Terminal output shared by the CLI commands."""

from __future__ import annotations

import sys

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """A rich console; wide enough for the tables when output goes to a file or a pipe."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=150)
