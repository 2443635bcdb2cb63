"""Which weights the demo, the benchmarks and the tests run: the trained tiny-16 checkpoint when it is there.

The checkpoint and its calibration table ship inside the package (pyproject.toml package-data), so an
installed kvstore finds them here as a checkout does; `kvstore demo` refuses to run without them
rather than fall back to random weights unasked."""

from __future__ import annotations

from pathlib import Path

import torch

from replay.model import ModelArgs, Transformer

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
DEFAULT_CHECKPOINT = CHECKPOINTS / "tiny16-stdlib.safetensors"


def load_model(checkpoint: str | Path | None = None, device: str | torch.device | None = None,
               fallback: ModelArgs | None = None) -> tuple[Transformer, str]:
    """(model, a line naming its weights): ``checkpoint`` (it must exist), else the committed trained tiny-16
    when present, else seeded random weights of ``fallback`` (tiny-16)."""
    path = Path(checkpoint) if checkpoint else DEFAULT_CHECKPOINT
    if path.exists():
        return Transformer.load_checkpoint(path, device=device), f"trained checkpoint {path.name}"
    if checkpoint:
        raise FileNotFoundError(f"no checkpoint at {path}")
    return (Transformer(fallback or ModelArgs.tiny16(), seed=0, device=device),
            f"seeded random weights (seed 0: no checkpoint at {path})")
