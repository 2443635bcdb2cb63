"""A cache record as engines lay them in their pages: what both engines' geometries are made of."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    """One cache record: ``data`` code bytes and ``scale`` bytes in ``arrangement`` (``split`` or
    ``interleaved``, kvstore/format/page_layout.py), pages padded to ``align``; ``name`` is what a layout's
    fingerprint says of it (e.g. SGLang's ``v41_fp4``)."""

    data: int
    scale: int
    arrangement: str
    align: int
    name: str = ""

    @property
    def nbytes(self) -> int:
        return self.data + self.scale
