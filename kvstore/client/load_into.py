"""Loads into the caller's memory (``Client.load_session_into`` / ``load_chunks_into`` / ``load_pages_into``): the
buffer, and the copy when the daemon cannot write there itself.

Same host, over the daemon's local socket, the daemon writes each verified chunk straight into the
caller's buffer (kvstore/transport/cma.py): the request names the buffer's address and size, the
kernel names the caller. Where that is not possible (another host, gRPC, a kernel that refuses the
write) the chunks come through the arena or the stream and are copied in here, packed the same way:
back to back from the buffer's start, in order, so the two paths give the same answer.

The buffer a default load (``Client.load_session()``) is answered in, on the daemon's host.

The daemon writes the whole answer into one buffer of the caller's (the ``load_session_into`` path
above), and the caller gets read-only views of it: one copy from the tier, no
allocation per chunk. What costs is fresh memory: every page of a new buffer faults in zeroed
(117 MB: ~20 ms with 2 MiB pages, twice that with 4 KiB ones, as much as the copy itself). So:

- a buffer is address space reserved at a size (``MAP_NORESERVE``), backed by transparent huge
  pages where the kernel has them; only what an answer reaches is ever touched;
- the client keeps the last one and answers the next load in it again, but only once nothing of the
  previous answer is alive: the views it handed out each hold the buffer, so while the caller keeps
  any of them (or anything made from them without a copy) the buffer is busy and a fresh one is
  taken. A view the caller may keep is therefore never written again under it.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.format import page
from kvstore.transport import cma, slots
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


def copy_into_slots(dests: Sequence[memoryview], region_of: Sequence[int], where: slots.Scatter, keys: Sequence[bytes],
                    pairs: Iterable[tuple[int, Blob]]) -> list[tuple[int, memoryview]]:
    """The (index, page blob) pairs of a load (through the arena or the stream), each blob's payload
    copied to its slot, ``dests[region_of[index]][where.offsets[index]:]``, as the daemon writes them on
    its host: (index, view of the payload in its region). A blob that is not the page ``keys[index]``
    names (its header, its checksum: checked again after the trip) is a miss, its slot untouched; a
    payload longer than its slot is InvalidArgument before any byte is copied."""
    got: list[tuple[int, memoryview]] = []
    for i, blob in pairs:
        try:
            body = page.payload(blob, keys[i])
        except page.PageError:
            continue
        if len(body) > (limit := int(where.slot_bytes[i])):
            raise InvalidArgument(f"key {i}'s block is {len(body)} bytes; CallerMemory.slot_bytes is {limit}")
        got.append((i, body))
    out = []
    for i, body in got:
        dest, at = dests[region_of[i]], int(where.offsets[i])
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


#: the least a buffer reserves (address space, not memory): a 1M-token DeepSeek-V4.1 session is 0.94 GB
MIN_RESERVE = 1 << 30


class LoadBuffers:
    """The buffer a default load is answered in: the one kept, while no view of it is alive, else a
    fresh one (kept from then on). Thread-safe: a buffer taken by one thread is busy for the others."""

    def __init__(self, keep_bytes: int, reserve_bytes: int = MIN_RESERVE) -> None:
        self.keep_bytes = keep_bytes  # a larger buffer is not kept after its load (its memory stays touched)
        self._size = reserve_bytes  # a fresh buffer's size: grows to the largest answer asked for
        self._kept: mmap.mmap | None = None
        self._lock = threading.Lock()

    def take(self, nbytes: int = 0) -> memoryview:
        """A writable buffer of at least ``nbytes`` bytes that nobody else holds (fresh ones are as large
        as the largest asked for). Its memory is the caller's while any view of it lives."""
        with self._lock:
            kept = self._kept
            # references: self._kept, ``kept``, getrefcount's argument; any more is a view alive
            if kept is not None and len(kept) >= nbytes and sys.getrefcount(kept) == 3:
                return memoryview(kept)
            self._size = max(self._size, nbytes)
            buf = _reserve(self._size)
            self._kept = buf if len(buf) <= max(self.keep_bytes, MIN_RESERVE) else None
            return memoryview(buf)

    def close(self) -> None:
        """Forget the kept buffer (unmapped once no view of it is alive)."""
        with self._lock:
            self._kept = None


def _reserve(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory, reserved (no swap accounted) and touched only as written,
    in 2 MiB pages where the kernel's transparent huge pages allow it (``madvise`` mode)."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages here: 4 KiB pages, the same answer
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf
