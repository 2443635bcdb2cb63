"""Cross-memory writes (kvstore/transport/cma.py) into a real second process's buffer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.transport import cma

CHILD = textwrap.dedent("""
    import sys, numpy as np
    buf = np.zeros(int(sys.argv[1]) if len(sys.argv) > 1 else 4096, np.uint8)
    print(buf.ctypes.data, flush=True)
    sys.stdin.readline()  # written meanwhile
    print(bytes(buf).hex(), flush=True)
""")


def spawn(size: int = 4096) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], int]]:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    addr = int(p.stdout.readline())
    yield p, addr
    p.kill()
    p.wait()


def finish(p: subprocess.Popen[str]) -> bytes:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    return bytes.fromhex(p.stdout.readline().strip())


def test_pieces_land_at_their_offsets(child: tuple[subprocess.Popen[str], int]) -> None:
    p, addr = child
    a, b = b"hello", np.arange(1, 5, dtype=np.uint8)
    cma.write(p.pid, [(cma.address_of(a), 5), (cma.address_of(b), 4)], addr, 4096, [0, 4092])
    got = finish(p)
    assert got[:5] == b"hello" and got[4092:] == bytes([1, 2, 3, 4]) and not any(got[5:4092])


def test_many_pieces_cross_the_iovec_limit(child: tuple[subprocess.Popen[str], int]) -> None:
    p, addr = child
    src = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)
    pieces = [(cma.address_of(src) + i, 1) for i in range(3000)]
    cma.write(p.pid, pieces, addr, 4096, list(range(3000)))  # 3 system calls
    assert finish(p)[:3000] == src.tobytes()


@pytest.mark.parametrize("threads", [2, 4])
def test_a_long_write_split_over_threads_lands_whole(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma, "WRITE_THREADS", threads)
    size = 2 * cma.SPLIT_BYTES + (3 << 20)
    p, addr = spawn(size)
    try:
        src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        piece = 229_000  # chunk-sized pieces, written in reverse order of their sources
        starts = list(range(0, size, piece))
        pieces = [(cma.address_of(src) + s, min(piece, size - s)) for s in reversed(starts)]
        offsets = list(reversed(starts))
        cma.write(p.pid, pieces, addr, size, offsets)
        assert finish(p) == src.tobytes()
    finally:
        p.kill()
        p.wait()


def test_a_piece_past_the_destination_moves_nothing(child: tuple[subprocess.Popen[str], int]) -> None:
    p, addr = child
    a = b"x" * 8
    with pytest.raises(ValueError, match="past the destination"):
        cma.write(p.pid, [(cma.address_of(a), 8), (cma.address_of(a), 8)], addr, 4096, [0, 4090])
    assert not any(finish(p))


def test_an_unmapped_destination_is_an_error(child: tuple[subprocess.Popen[str], int]) -> None:
    p, _ = child
    a = b"y" * 8
    with pytest.raises(cma.CrossMemoryError, match="Bad address"):
        cma.write(p.pid, [(cma.address_of(a), 8)], 4096, 8, [0])  # page 1 is never mapped
    finish(p)


def test_another_process_that_is_gone_is_an_error() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    a = b"z"
    with pytest.raises(cma.CrossMemoryError):
        cma.write(p.pid, [(cma.address_of(a), 1)], 1 << 20, 1, [0])
