"""Real text every machine has: the Python standard library's own sources, as byte tokens.

``stdlib_tokens``: the top-level files (the demo's sessions). ``split_bytes``: every file, split by a hash of
its path into train and held-out (training, the held-out evaluation and the fidelity benchmark).

The demo, the benchmarks and the tests use it so that sessions hold real text, not noise, without
downloading anything (vocab 256: one token per byte).
"""

from __future__ import annotations

import hashlib
import os
import sys
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


def stdlib_dir() -> Path:
    return Path(os.__file__).parent


def is_heldout(rel: str) -> bool:
    """The deterministic train / held-out split, by file: about 1 file in 20 is held out."""
    return hashlib.sha256(rel.encode()).digest()[0] % 20 == 0


def split_files(split: str) -> list[Path]:
    """Every .py file of the standard library (site-packages excluded) in sorted order, one split of them."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_dir()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    return [p for p in files if is_heldout(p.relative_to(root).as_posix()) == (split == "heldout")]


def split_bytes(split: str, limit: int | None = None) -> bytes:
    """One split's files concatenated in sorted order (the first ``limit`` bytes, if given)."""
    out = bytearray()
    for path in split_files(split):
        out += path.read_bytes()
        if limit is not None and len(out) >= limit:
            return bytes(out[:limit])
    return bytes(out)


def main() -> None:
    """python -m replay.corpus DIR: write train.bin and heldout.bin (raw bytes) for a machine that trains."""
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        data = split_bytes(split)
        (out / f"{split}.bin").write_bytes(data)
        print(f"{split}: {len(split_files(split))} files, {len(data):,} bytes (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
