"""Checks for what operators type: each answers a mistake in one line, before anything starts.

Used as argparse ``type=`` functions (argparse prints ``kvstore serve: error: argument --port: ...``
and exits 2) or, for settings that may also come from the environment or a TOML file, on the
finished config (``check_data_dir``).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: the daemon picks a free one)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a number 0-65535, got {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {n}")
    return n


def address(text: str) -> str:
    """HOST:PORT (an IPv6 host in brackets: [::1]:50151), port 1-65535. gRPC would take a bare host
    and quietly dial port 443."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or host in ("[", "[]"):
        raise argparse.ArgumentTypeError(f"address must be HOST:PORT (e.g. 127.0.0.1:50151), got {text!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"an IPv6 address needs brackets, e.g. [::1]:50151; got {text!r}")
    n = port(port_text)
    if n == 0:
        raise argparse.ArgumentTypeError(f"port 0 cannot be dialled; got {text!r}")
    return text


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number ``lo``..``hi`` (no upper bound when ``hi`` is None)."""

    def parse(text: str) -> int:
        want = f"a whole number {lo}-{hi}" if hi is not None else f"a whole number >= {lo}"
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


def log_level(text: str) -> str:
    """One of Python's level names, any case."""
    level = text.upper()
    if level not in LOG_LEVELS or not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"log level must be one of {', '.join(LOG_LEVELS)} (any case), got {text!r}")
    return level


def check_data_dir(path: str) -> str | None:
    """Why ``path`` cannot be the daemon's data directory, or None if it can (it exists as a writable
    directory, or it can be created: its nearest existing ancestor is a writable directory)."""
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            return f"data dir {path} exists and is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"data dir {path} is not writable by this user"
        return None
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"data dir {path} cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"data dir {path} cannot be created: {parent} is not writable by this user"
    return None
