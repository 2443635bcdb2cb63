"""Content-addressed, chained chunk keys.

key_i = xxh3_128(domain, layout id, namespace, key_{i-1}, token ids of chunk i)

Like a prefix hash (nano-vllm's block manager): a chunk's key depends on every token before it,
so equal keys mean equal prefixes, and sessions that share a prefix share chunks. The hash is
fixed and seedless, so keys agree across processes, machines and PYTHONHASHSEED values. A hit is
still verified against the token ids stored in the chunk: a collision is a miss, never wrong data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import xxhash

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)  # the parent of a sequence's first chunk
_DOMAIN = b"kvstore.chunk.v1\x00"

TokenIds: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor"


def token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as little-endian uint32: the canonical form for hashing and storing."""
    detach = getattr(token_ids, "detach", None)  # a torch tensor (torch is not imported here: CLI start-up stays fast)
    if detach is not None:
        token_ids = detach().cpu().numpy()
    arr: np.ndarray = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def chunk_key(layout_id: bytes, namespace: str, parent: bytes, token_ids: TokenIds) -> bytes:
    """The 16-byte key of one chunk, given its parent's key (``ROOT`` for the first chunk)."""
    if len(layout_id) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise ValueError("layout id and parent key must be 16 bytes")
    return _key_raw(layout_id, namespace, parent, token_bytes(token_ids))


def chain_keys(layout_id: bytes, namespace: str, token_ids: TokenIds, chunk_tokens: int) -> list[bytes]:
    """Keys of every *complete* chunk of ``token_ids`` (a trailing partial chunk has no key)."""
    if len(layout_id) != KEY_BYTES:
        raise ValueError("layout id must be 16 bytes")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    raw = token_bytes(token_ids)
    step = chunk_tokens * 4
    keys: list[bytes] = []
    parent = ROOT
    for off in range(0, len(raw) - step + 1, step):
        parent = _key_raw(layout_id, namespace, parent, raw[off : off + step])
        keys.append(parent)
    return keys


def chunk_key_raw(layout_id: bytes, namespace: str, parent: bytes, raw: bytes | memoryview) -> bytes:
    """``chunk_key`` of token ids already in their canonical form (uint32 LE bytes, e.g. a stored
    chunk's own): no conversion, so verifying a hit costs one xxh3 pass over them."""
    if len(layout_id) != KEY_BYTES or len(parent) != KEY_BYTES:
        raise ValueError("layout id and parent key must be 16 bytes")
    return _key_raw(layout_id, namespace, parent, raw)


def _key_raw(layout_id: bytes, namespace: str, parent: bytes, raw: bytes | memoryview) -> bytes:
    ns = namespace.encode()
    h = xxhash.xxh3_128()
    for part in (_DOMAIN, layout_id, len(ns).to_bytes(2, "little"), ns, parent, raw):
        h.update(part)
    return h.digest()
