"""A checkpoint's calibrated replay length: measured error of bounded replay for each replay length R.

``benchmarks/fidelity/bench_fidelity.py`` measures it on held-out sessions and writes it beside the checkpoint
(``<name>.calibration.json``); ``Transformer.load_checkpoint`` reads it back as ``model.calibration``, and
``AgentSession.resume(..., max_kl=...)`` picks the smallest R whose measured mean KL meets the budget.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CalibrationRow:
    replay_tokens: int
    mean_kl: float  # nats per next-token distribution, KL(never evicted || resumed), over the measured resumes
    max_kl: float  # the worst single step seen
    top1: float  # top-1 agreement with the never-evicted session


@dataclass(frozen=True)
class Calibration:
    weights: str  # the checkpoint it was measured on
    history: int  # history length of the measured sessions (tokens)
    resumes: int  # resumes per replay length
    rows: tuple[CalibrationRow, ...]  # ascending replay_tokens

    @staticmethod
    def path_for(checkpoint: Path) -> Path:
        return checkpoint.with_name(checkpoint.name.removesuffix(".safetensors") + ".calibration.json")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        raw = json.loads(path.read_text())
        rows = tuple(sorted((CalibrationRow(**r) for r in raw.pop("rows")), key=lambda r: r.replay_tokens))
        return cls(rows=rows, **raw)

    def expected(self, replay_tokens: int) -> CalibrationRow:
        """The measured error at the largest calibrated R <= replay_tokens (the smallest R if below all)."""
        below = [r for r in self.rows if r.replay_tokens <= replay_tokens]
        return below[-1] if below else self.rows[0]

    def pick(self, max_kl: float) -> CalibrationRow:
        """The smallest calibrated R from which on every calibrated R has mean KL <= max_kl."""
        if max_kl < 0:
            raise ValueError(f"max_kl must be >= 0, got {max_kl}")
        best = None
        for row in reversed(self.rows):
            if row.mean_kl > max_kl:
                break
            best = row
        if best is None:
            raise ValueError(f"no calibrated replay length reaches mean KL <= {max_kl:g} (largest R "
                             f"{self.rows[-1].replay_tokens}: {self.rows[-1].mean_kl:.3g}); use mode='exact'")
        return best
