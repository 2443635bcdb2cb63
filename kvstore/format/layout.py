"""Declarative description of the global caches a model persists.

A :class:`Layout` lists, per persisted cache, its source layer, compression ratio m, channel
count and entry format. Everything else (entries per token, bytes per entry, bytes per token) is
derived. A layout has a stable id, a hash of its definition, that goes into every chunk key and
every chunk header, so data written under one layout can never be read under another.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import cached_property


class EntryFormat(enum.StrEnum):
    """How one entry (one compressed position of one cache) is packed."""

    #: FP4 E2M1 codes (two per byte) + one float8_e4m3fn scale per 16 channels (NVFP4, no global scale).
    FP4_E4M3_16 = "fp4-e2m1/e4m3x16"
    #: FP4 E2M1 codes + one UE8M0 exponent byte per 32 channels (MXFP4).
    FP4_UE8M0_32 = "fp4-e2m1/ue8m0x32"
    #: V4-Flash-style main KV entry kept for byte comparisons only (448 FP8 + 64 BF16 + 8 scale).
    FP8_BF16_MIXED = "fp8-bf16-mixed"

    @property
    def block(self) -> int:
        return {"fp4-e2m1/e4m3x16": 16, "fp4-e2m1/ue8m0x32": 32, "fp8-bf16-mixed": 64}[self.value]

    def code_bytes(self, channels: int) -> int:
        if self is EntryFormat.FP8_BF16_MIXED:
            return (channels - 64) + 64 * 2
        return channels // 2

    def scale_bytes(self, channels: int) -> int:
        return channels // self.block


@dataclass(frozen=True)
class CacheSpec:
    """One persisted global cache: e.g. the main KV of source layer 2, compressed m=2."""

    name: str
    layer: int
    m: int
    channels: int
    fmt: EntryFormat

    def __post_init__(self) -> None:
        if self.m < 1:
            raise ValueError(f"cache {self.name}: compression ratio m must be >= 1, got {self.m}")
        if self.channels % self.fmt.block:
            raise ValueError(
                f"cache {self.name}: {self.channels} channels is not a multiple of the "
                f"{self.fmt.value} block of {self.fmt.block}"
            )

    @property
    def code_bytes(self) -> int:
        """Bytes of packed codes per entry."""
        return self.fmt.code_bytes(self.channels)

    @property
    def scale_bytes(self) -> int:
        """Bytes of scales per entry."""
        return self.fmt.scale_bytes(self.channels)

    @property
    def entry_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes

    @property
    def entries_per_token(self) -> Fraction:
        return Fraction(1, self.m)

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.entry_bytes, self.m)

    def entries_for(self, tokens: int) -> int:
        """Complete entries covering the first ``tokens`` tokens (a trailing partial group is not one)."""
        return tokens // self.m


@dataclass(frozen=True)
class Layout:
    """A model's persisted global caches, plus what the store needs to know about its SWA state."""

    name: str
    caches: tuple[CacheSpec, ...]
    n_layers: int
    window: int = 128
    #: Bytes of one layer's SWA entry for one token (what V4.1 never persists).
    swa_entry_bytes: int = 0
    #: Whether the model persists an SWA snapshot at turn boundaries (the V4-Flash baseline does).
    persists_swa: bool = False

    def __post_init__(self) -> None:
        names = [c.name for c in self.caches]
        if len(set(names)) != len(names):
            raise ValueError(f"layout {self.name}: duplicate cache names {names}")
        if not self.caches:
            raise ValueError(f"layout {self.name}: no caches")

    @cached_property
    def layout_id(self) -> bytes:
        """16-byte stable id: blake2b-128 of the canonical JSON of the definition (name excluded)."""
        d = asdict(self)
        d.pop("name")
        for c in d["caches"]:
            c["fmt"] = c["fmt"].value if isinstance(c["fmt"], EntryFormat) else c["fmt"]
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(blob, digest_size=16).digest()

    @property
    def layout_hex(self) -> str:
        return self.layout_id.hex()

    @property
    def bytes_per_token(self) -> Fraction:
        """Persisted global-KV bytes per token, from the formula (exact)."""
        return sum((c.bytes_per_token for c in self.caches), Fraction(0))

    @property
    def entries_per_token(self) -> Fraction:
        return sum((c.entries_per_token for c in self.caches), Fraction(0))

    @property
    def swa_state_bytes(self) -> int:
        """One sequence's full SWA state: layers x window x entry bytes."""
        return self.n_layers * self.window * self.swa_entry_bytes

    @property
    def granularity(self) -> int:
        """Least common multiple of every m: a chunk size must be a multiple of it."""
        from math import lcm

        return lcm(*(c.m for c in self.caches))

    def cache(self, name: str) -> CacheSpec:
        for c in self.caches:
            if c.name == name:
                return c
        raise KeyError(f"layout {self.name} has no cache {name!r}")

    def chunk_payload_bytes(self, tokens: int) -> int:
        """Bytes of packed entries for ``tokens`` tokens (codes + scales of every cache)."""
        return sum(c.entries_for(tokens) * c.entry_bytes for c in self.caches)


def _v41_style(name: str, enc_sources: tuple[int, ...], dec_source: int, n_layers: int, main_dim: int,
               idx_dim: int, swa_dim: int) -> Layout:
    caches: list[CacheSpec] = []
    for layer, m in [*((s, 2) for s in enc_sources), (dec_source, 1)]:
        caches.append(CacheSpec(f"main.L{layer}", layer, m, main_dim, EntryFormat.FP4_E4M3_16))
        caches.append(CacheSpec(f"index.L{layer}", layer, m, idx_dim, EntryFormat.FP4_UE8M0_32))
    # SWA entry: FP8 E4M3 codes + one UE8M0 scale per 32 channels.
    return Layout(name, tuple(caches), n_layers=n_layers, window=128, swa_entry_bytes=swa_dim + swa_dim // 32)


def _v4_flash() -> Layout:
    """The V4-Flash baseline: 21 CSA layers (m=4, 584-byte entries + 68-byte indexer) and 20 HCA
    layers (m=128); it persists an SWA snapshot (43 x 128 x 584) at every turn boundary."""
    caches: list[CacheSpec] = []
    csa = [*range(2, 43, 2)]  # 21 CSA layers
    hca = [*range(3, 43, 2)][:20]  # 20 HCA layers
    for layer in csa:
        caches.append(CacheSpec(f"main.L{layer}", layer, 4, 512, EntryFormat.FP8_BF16_MIXED))
        caches.append(CacheSpec(f"index.L{layer}", layer, 4, 128, EntryFormat.FP4_UE8M0_32))
    for layer in hca:
        caches.append(CacheSpec(f"main.L{layer}", layer, 128, 512, EntryFormat.FP8_BF16_MIXED))
    return Layout("deepseek-v4-flash", tuple(caches), n_layers=43, window=128, swa_entry_bytes=584,
                  persists_swa=True)


PRESETS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        _v41_style("deepseek-v4.1-flash", (2, 8, 14), 20, 40, 512, 128, 512),
        _v4_flash(),
        _v41_style("tiny-16", (2, 4, 6), 8, 16, 128, 32, 128),
        _v41_style("tiny-8", (2,), 4, 8, 128, 32, 128),
    )
}


def get_layout(name: str) -> Layout:
    """Look up a preset by name; ValueError lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def layout_by_id(layout_id: bytes) -> Layout | None:
    for lay in PRESETS.values():
        if lay.layout_id == layout_id:
            return lay
    return None
