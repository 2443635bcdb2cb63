"""Loads into the caller's memory (``Client.load_session_into`` / ``load_chunks_into`` / ``load_pages_into``): the
buffer, and the copy when the daemon cannot write there itself.

Same host, over the daemon's local socket, the daemon writes each verified chunk straight into the
caller's buffer (kvstore/transport/cma.py): the request names the buffer's address and size, the
kernel names the caller. Where that is not possible (another host, gRPC, a kernel that refuses the
write) the chunks come through the arena or the stream and are copied in here, packed the same way:
back to back from the buffer's start, in order, so the two paths give the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.format import page
from kvstore.transport import cma
from kvstore.transport.framing import Blob

_YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")


def writable(out: Any) -> memoryview:
    """``out`` as a flat writable byte view: a numpy array, a CPU (pinned or not) torch tensor, a
    bytearray, a memoryview; C-contiguous. A CUDA tensor is refused (``load_session_to_device``
    loads into device memory)."""
    if hasattr(out, "is_cuda") and out.is_cuda:
        raise InvalidArgument("load_session_into writes host memory: use load_session_to_device for a CUDA tensor")
    if hasattr(out, "numpy") and hasattr(out, "data_ptr"):  # a torch tensor: its storage, as numpy sees it
        out = out.detach().numpy()
    try:
        mv = memoryview(out)
    except TypeError:
        raise InvalidArgument(f"load_session_into needs a writable buffer, got {type(out).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        raise InvalidArgument("load_session_into needs a writable, C-contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def address(dest: memoryview) -> int:
    return cma.address_of(dest)


def copy_into(dest: memoryview, pairs: Iterable[tuple[int, Blob]]) -> list[tuple[int, memoryview]]:
    """The (index, blob) pairs of a load copied back to back into ``dest``: (index, view of ``dest``)."""
    out, off = [], 0
    for i, blob in pairs:
        n = len(blob)
        if off + n > len(dest):
            raise ResourceExhausted(f"the destination holds {len(dest)} bytes; this load needs more than "
                                    f"{off + n} (chunk {i} does not fit)")
        dest[off : off + n] = blob
        out.append((i, dest[off : off + n]))
        off += n
    return out


def copy_into_slots(dest: memoryview, offsets: np.ndarray, slot_bytes: int, keys: Sequence[bytes],
                    pairs: Iterable[tuple[int, Blob]]) -> list[tuple[int, memoryview]]:
    """The (index, page blob) pairs of a load (through the arena or the stream), each blob's payload
    copied to its slot ``dest[offsets[index]:]``, as the daemon writes them on its host: (index, view
    of the payload in ``dest``). A blob that is not the page ``keys[index]`` names (its header, its
    checksum: checked again after the trip) is a miss, its slot untouched; a payload longer than
    ``slot_bytes`` is InvalidArgument before any byte is copied."""
    got: list[tuple[int, memoryview]] = []
    for i, blob in pairs:
        try:
            body = page.payload(blob, keys[i])
        except page.PageError:
            continue
        if len(body) > slot_bytes:
            raise InvalidArgument(f"key {i}'s block is {len(body)} bytes; the slots hold {slot_bytes}")
        got.append((i, body))
    out = []
    for i, body in got:
        at = int(offsets[i])
        dest[at : at + len(body)] = body
        out.append((i, dest[at : at + len(body)]))
    return out


def allow_daemon(daemon_pid: int) -> None:
    """Under Yama ptrace_scope 1 a process may write into another's memory only if that one named it
    (PR_SET_PTRACER): name the daemon, whose local socket this client already trusts with its data."""
    try:
        scope = _YAMA.read_text().strip()
    except OSError:
        return  # no Yama: same-uid writes are allowed as they are
    if scope == "1":
        cma.allow_writes_from(daemon_pid)
