"""SGLang's host pools as regions of slots: where each page of a ``PoolTransfer`` lies in host memory.

A ``page_first`` host pool (what CUDA deployments use for L3) is one C-contiguous buffer of
``[pages, layers, item_bytes]``: page ``r`` is the ``layers * item_bytes`` bytes at ``r * page_bytes``,
so the daemon reads a stored page from its slot and writes a loaded one into it itself (one copy,
``Client.save_pages`` / ``Client.load_pages_into``). Any other layout (``layer_first``: one buffer per
layer) is reached through the pool's own ``get_data_page`` / ``set_from_flat_data_page``, which
gather and scatter the same bytes in the same order: pages stored from either layout are equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.engines.sglang.geometry import Pool


@dataclass(frozen=True)
class HostPages:
    """One registered host pool: its geometry and its memory."""

    pool: Pool
    host_pool: Any  # SGLang's HostKVCache (DeepSeekV4PagedHostPool for V4.1)

    @property
    def region(self) -> torch.Tensor | None:
        """The pool's whole buffer, when its pages are slots of it (``page_first``); else None."""
        buf = getattr(self.host_pool, "kv_buffer", None)
        layout = getattr(self.host_pool, "layout", None)
        if (layout not in ("page_first", "page_first_direct") or not isinstance(buf, torch.Tensor)
                or buf.device.type != "cpu" or not buf.is_contiguous() or buf.dim() < 2
                or buf[0].numel() * buf.element_size() != self.pool.page_bytes):
            return None
        return buf

    def rows(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        """The host page of each of ``n`` pages (their first token slot over the pool's page size);
        None when ``host_indices`` does not name ``n`` whole pages."""
        ps = self.pool.page_tokens
        if host_indices is None or host_indices.numel() != n * ps:
            return None
        firsts = host_indices.reshape(-1)[::ps].to("cpu", torch.int64)
        return (firsts // ps).tolist()

    def offsets(self, rows: list[int]) -> list[int]:
        return [r * self.pool.page_bytes for r in rows]

    def read(self, row: int) -> np.ndarray:
        """Page ``row``'s bytes, gathered by the pool (layouts without slots)."""
        page = self.host_pool.get_data_page(row * self.pool.page_tokens, flat=True)
        return page.contiguous().view(torch.uint8).numpy()

    def write(self, row: int, data: memoryview) -> None:
        """Page ``row`` set from ``data`` by the pool (layouts without slots)."""
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.host_pool.set_from_flat_data_page(row * self.pool.page_tokens, src)
