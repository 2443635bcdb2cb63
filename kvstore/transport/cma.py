"""Cross-memory writes (and reads): the daemon copies chunk bytes straight into a same-host client's own
buffer (and an engine's page bytes out of it: ``read``, kvstore/transport/slots.py).

A load into the caller's memory (``Client.load_session_into``) names a destination in the client's
address space (an address and a length: a numpy array, a pinned torch tensor, an engine's KV view).
Over the local socket the daemon learns from the kernel which process sent that very request (its
messages carry the sender's credentials and a pidfd: kvstore/transport/sender.py), never from the
request nor from the connect, and copies each verified chunk from where the tier holds it (the host
tier's bytes, LMDB's map) into that destination with ``process_vm_writev(2)``, only while the sender's
pidfd says it is alive: one copy from the tier, no shared mapping, no arena to size. A client can only
make the daemon write into its own process, within the ranges it named (the kernel refuses addresses
the process has not mapped writable: EFAULT, a failed call, no partial write is acknowledged); a
forked child or a process handed the socket is a caller of its own.

The kernel allows it when the daemon may ptrace the client: same uid and, under Yama's
``ptrace_scope`` 1, only if the client named the daemon its ptracer (``allow_writes_from``). Where it is
refused (another uid, Yama 2+, a seccomp filter, a kernel without CMA) the write fails with EPERM or
ENOSYS before any byte moves: the daemon answers FAILED_PRECONDITION with the reason, and the client
remembers it and loads through its arena instead.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

#: iovecs per process_vm_writev call (the kernel's UIO_MAXIOV)
MAX_IOV = 1024
#: a write this large is split over threads, one per half of this, up to WRITE_THREADS (the copies
#: are the kernel's: they run side by side, one core each)
SPLIT_BYTES = 16 << 20
WRITE_THREADS = max(1, min(4, os.cpu_count() or 1))
PR_SET_PTRACER = 0x59616D61

_libc = ctypes.CDLL(None, use_errno=True)
_writev = getattr(_libc, "process_vm_writev", None)
_readv = getattr(_libc, "process_vm_readv", None)
for _fn in (_writev, _readv):
    if _fn is not None:
        _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        _fn.restype = ctypes.c_ssize_t


class CrossMemoryError(OSError):
    """A cross-memory write failed: refused (EPERM, ENOSYS) or a destination not mapped writable (EFAULT)."""


def address_of(buf: memoryview | bytes | bytearray | np.ndarray) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(buf, np.uint8).ctypes.data) if not isinstance(buf, np.ndarray) else int(buf.ctypes.data)


def allow_writes_from(pid: int) -> None:
    """Let ``pid`` (the daemon) write into this process under Yama ptrace_scope 1; harmless elsewhere."""
    _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def write(pid: int, sources: Sequence[tuple[int, int]] | np.ndarray, dest: int, dest_len: int,
          offsets: Sequence[int] | np.ndarray) -> None:
    """Copy each (address, length) of ``sources`` (in this process) to ``dest + offsets[i]`` in process
    ``pid``. Every piece must lie inside [dest, dest + dest_len): checked here before any byte moves.
    One system call per ``MAX_IOV`` pieces; raises CrossMemoryError unless every byte was written."""
    _move(_writev, "process_vm_writev", pid, sources, dest, dest_len, offsets)


def read(pid: int, dests: Sequence[tuple[int, int]] | np.ndarray, src: int, src_len: int,
         offsets: Sequence[int] | np.ndarray) -> None:
    """``write``'s mirror: fill each (address, length) of ``dests`` (in this process) from ``src +
    offsets[i]`` in process ``pid``, every piece inside [src, src + src_len) (checked first);
    CrossMemoryError unless every byte was read."""
    _move(_readv, "process_vm_readv", pid, dests, src, src_len, offsets)


def _move(fn: Callable[..., int] | None, name: str, pid: int, sources: Sequence[tuple[int, int]] | np.ndarray,
          dest: int, dest_len: int, offsets: Sequence[int] | np.ndarray) -> None:
    """``write`` or ``read`` (``fn``): the local pieces ``sources``, the remote ones at ``dest + offsets``."""
    if fn is None:
        raise CrossMemoryError(errno.ENOSYS, f"{name} is not available")
    n = len(sources)
    if n != len(offsets):
        raise ValueError("one offset per source")
    if n == 0:
        return
    table = np.empty((n, 2, 2), np.uint64)  # per piece: local iovec (base, len), remote iovec (base, len)
    src = np.asarray(sources, np.uint64).reshape(n, 2)
    off = np.asarray(offsets, np.uint64)
    if int((off + src[:, 1]).max()) > dest_len:
        raise ValueError(f"a piece ends past the destination's {dest_len} bytes")
    table[:, 0] = src
    table[:, 1, 0] = off + np.uint64(dest)
    table[:, 1, 1] = src[:, 1]
    local = np.ascontiguousarray(table[:, 0])
    remote = np.ascontiguousarray(table[:, 1])
    total = int(src[:, 1].sum())
    threads = 1 if total < SPLIT_BYTES else min(WRITE_THREADS, n, -(-total // (SPLIT_BYTES // 2)))
    # a long load: that many system calls at once, on as many cores, each over its own run of pieces
    bounds = [n * t // threads for t in range(threads + 1)]
    parts = [[(start, min(b, start + MAX_IOV)) for start in range(a, b, MAX_IOV)]
             for a, b in itertools.pairwise(bounds)]
    if threads == 1:
        _spans(fn, name, pid, local, remote, src, parts[0], None)
        return
    errors: list[BaseException] = []
    helpers = [threading.Thread(target=_spans, args=(fn, name, pid, local, remote, src, part, errors))
               for part in parts[1:]]
    for h in helpers:
        h.start()
    try:
        _spans(fn, name, pid, local, remote, src, parts[0], errors)
    finally:
        for h in helpers:
            h.join()
    if errors:
        raise errors[0]


def _spans(fn: Callable[..., int], name: str, pid: int, local: np.ndarray, remote: np.ndarray, src: np.ndarray,
           spans: list[tuple[int, int]], errors: list[BaseException] | None) -> None:
    """One system call per span of iovecs (ctypes releases the GIL for each)."""
    try:
        for start, stop in spans:
            want = int(src[start:stop, 1].sum())
            got = fn(pid, local[start:].ctypes.data, stop - start, remote[start:].ctypes.data, stop - start, 0)
            if got != want:
                err = ctypes.get_errno() if got < 0 else errno.EFAULT
                raise CrossMemoryError(err, f"{name} with pid {pid}: {os.strerror(err)} "
                                            f"({max(got, 0)} of {want} bytes moved)")
    except BaseException as e:
        if errors is None:
            raise
        errors.append(e)
