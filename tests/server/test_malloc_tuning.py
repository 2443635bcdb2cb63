"""The daemon keeps freed memory for reuse (kvstore/server/malloc_tuning.py): a buffer of a chunk's
size allocated and freed over and over stops faulting in fresh pages every time."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

CHURN = """
import resource, sys, threading
from kvstore.server.malloc_tuning import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
def churn():  # what a save does in a worker thread: five chunk-sized buffers and a turn-sized one
    for _ in range(200):
        bufs = [bytearray(230_000) for _ in range(5)] + [bytearray(1_200_000)]
        for b in bufs:
            b[::4096] = b"x" * len(b[::4096])  # touch every page
        del bufs
out = []
def run():
    churn()  # glibc's own thresholds adapt over the first frees: measure the steady state after
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    churn()
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
t = threading.Thread(target=run)
t.start()
t.join()
print(out[0])
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_chunk_sized_buffers_churned_in_a_thread_stop_faulting_once_memory_is_kept() -> None:
    tuned, default = faults("tuned"), faults("default")
    assert tuned <= 20  # 200 rounds of 6 buffers, 400 pages a round: no fresh pages but a few
    if default >= 100:  # where glibc's defaults fault (they did here: ~600), keeping memory must beat them
        assert tuned * 10 < default
