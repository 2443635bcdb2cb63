"""Defaults both sides of the wire need, in a module the clients import without any server code."""

from __future__ import annotations

DEFAULT_PORT = 50151  # the daemon's gRPC port when none is given
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
