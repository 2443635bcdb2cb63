"""Terminal output shared by the CLI commands."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.table import Table


def console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width, or $COLUMNS; 150 columns when output goes to a file or a pipe."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):  # a terminal, or a width asked for: rich follows it
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=150)


def numbers_right(table: Table, first: int = 1) -> Table:
    """Right-align columns ``first``.. (the numbers), so that digits line up; the table."""
    for column in table.columns[first:]:
        column.justify = "right"
    return table
