"""Terminal output shared by the CLI commands."""

from __future__ import annotations

import os
import sys

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text


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


def framed(table: Table) -> Group:
    """The table with its title above and its caption below as lines of their own: they wrap at the
    console's width, not at the table's (a narrow table would squeeze them into a column)."""
    parts: list[RenderableType] = []
    if table.title:
        parts.append(Text.from_markup(table.title, style="bold") if isinstance(table.title, str) else table.title)
    caption, table.title, table.caption = table.caption, None, None
    parts.append(table)
    if caption:
        parts.append(Text.from_markup(caption, style="dim") if isinstance(caption, str) else caption)
    return Group(*parts)
