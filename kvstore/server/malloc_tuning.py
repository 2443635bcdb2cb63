"""Keep the daemon's freed memory for reuse instead of handing it back to the kernel at every free.

glibc serves a request over its mmap threshold (128 KiB at first) with a fresh mmap and unmaps it
on free, and trims a thread arena's heap (MADV_DONTNEED) whenever its free top passes the trim
threshold. A save moves chunks of ~230 KB through several buffers (the arena copy, LMDB's
overflow pages, the records), so each of them was a fresh mapping whose every page faulted on
first touch: LMDB's puts of a 1.1 MB turn took 0.87 ms in the daemon and 0.12 ms once the memory
was kept (benchmarks/results/daemon.md). Raising both thresholds makes such buffers come from the
heap and stay there: the daemon's resident size then tracks its peak working set, not its
current one, bounded by ``KEEP_BYTES`` of free memory per malloc arena, and the arenas are at most
``ARENAS`` (glibc's default is 8 per core: on a 64-core host, 512 arenas could each keep their
share). Most allocations happen under the GIL, one thread at a time, so a few arenas cost little
contention.

Linux with glibc only; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger("kvstore.server")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit)
KEEP_BYTES = 256 << 20  # free memory an arena keeps before trimming
ARENAS = 4  # malloc arenas at most: with KEEP_BYTES, ~1 GiB of free memory kept at worst


def keep_freed_memory() -> bool:
    """Apply the thresholds to this process; whether they were applied."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in
                 ((M_ARENA_MAX, ARENAS), (M_MMAP_THRESHOLD, MMAP_BYTES), (M_TRIM_THRESHOLD, KEEP_BYTES)))
    except (OSError, AttributeError) as e:
        log.debug("mallopt unavailable: %s", e)
        return False
    return bool(ok)
