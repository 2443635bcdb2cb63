"""Real text every machine has: the Python standard library's own sources, as byte tokens.

The demo, the benchmarks and the tests use it so that sessions hold real text, not noise, without
downloading anything (vocab 256: one token per byte).
"""

from __future__ import annotations

import os
from pathlib import Path


def stdlib_tokens(n: int) -> list[int]:
    """``n`` byte tokens: the standard library's top-level .py files, concatenated in sorted order."""
    out = bytearray()
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= n:
            break
    if len(out) < n:
        raise ValueError(f"the standard library holds only {len(out):,} bytes of sources, asked for {n:,}")
    return list(out[:n])
