"""What a tier in GPU memory offers beyond ``Tier``: copies of its values device to device.

The store finds the tier by this type (``TieredStore.hbm_tier``), never by its name, and hands
it to the same-GPU handoff (kvstore/server/device_arenas.py); the module imports no torch, so
a daemon without an HBM tier never loads it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.tiers.base import Tier

if TYPE_CHECKING:
    import torch


class DeviceTier(Tier):
    """A tier whose values live on one GPU (``device``)."""

    device: torch.device

    @abc.abstractmethod
    def copy_to(self, keys: Sequence[bytes], dst: torch.Tensor, offsets: Sequence[int]) -> list[bool]:
        """Copy each value device to device into ``dst`` (uint8, on ``device``) at its offset in
        ``offsets``; returns which keys were held. Done when it returns, and no value can be freed
        meanwhile."""
