"""Same-host shared memory: the arena a client creates, and what both sides need of an arena.

An arena is memory a client creates and shares with the daemon: chunk blobs move with one copy
into pages that already exist on both sides, instead of through gRPC messages. A client makes a
sealed memfd (``Arena.create_sealed``): every page allocated up front (fallocate), then sealed
against shrinking and growing, so neither side can ever find a page gone from under a mapping; it
hands the fd to the daemon over the local socket (SCM_RIGHTS, docs/LOCAL.md). A memfd lives on the
kernel's internal tmpfs, which has no size limit of its own: a small ``/dev/shm`` (Docker's default
is 64 MiB) does not constrain it. ``Arena.create`` makes a file in ``/dev/shm`` instead, for
daemons reached without the local socket; the daemon never maps such a file (its owner could
truncate it under the mapping: server/arena_attach.py).

``ArenaMemory`` is what the carriers (kvstore/transport/carrier.py) use of an arena, whichever side holds
it: write blobs at offsets, read them back, release it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from kvstore.transport.framing import Blob

NONCE_BYTES = 16
MAX_BYTES = 4 << 30
# seals a client's memfd carries: never smaller (a mapping of it cannot fault), never larger, and no
# seal may be added or removed after these (F_SEAL_SEAL)
SEAL_SHRINK, SEAL_GROW, SEAL_SEAL = (getattr(fcntl, n, v) for n, v in (("F_SEAL_SHRINK", 0x2), ("F_SEAL_GROW", 0x4),
                                                                      ("F_SEAL_SEAL", 0x1)))
SEALS = SEAL_SHRINK | SEAL_GROW | SEAL_SEAL
_MFD_NOEXEC_SEAL = 0x0008  # Linux 6.3+: a kernel with vm.memfd_noexec = 2 refuses memfds without it


def default_shm_dir() -> Path | None:
    """/dev/shm where it is a writable directory (Linux), else None: the stream path is used."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else None


def host_id() -> str:
    """Identical for processes on the same booted host: the kernel's boot id and the hostname."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


class ArenaMemory(ABC):
    """An arena as the carriers use it: ``size`` bytes that blobs are written into and read from."""

    size: int

    @abstractmethod
    def write(self, off: int, data: Blob) -> None:
        """``data`` at ``[off, off + len(data))`` (the caller keeps it within ``size``)."""

    @abstractmethod
    def read(self, off: int, n: int) -> bytes:
        """A copy of ``[off, off + n)``."""

    @abstractmethod
    def contents(self, n: int) -> Blob:
        """``[0, n)`` as one buffer to cut blobs from (a view where the arena is mapped)."""

    @abstractmethod
    def close(self) -> None:
        """Release this side's hold on the memory (the other side's stays)."""


class Arena(ArenaMemory):
    """A mapped arena: a client's own (either kind), or a sealed memfd the daemon was handed. The
    memory lives while either side maps it."""

    def __init__(self, mm: mmap.mmap, path: str = "", nonce: bytes = b"", fd: int = -1) -> None:
        self._mm = mm
        self.view = memoryview(mm)
        self.size = len(mm)
        self.path = path  # a /dev/shm file's name until its creator unlinks it; "" for a memfd
        self.nonce = nonce  # written at offset 0 by its creator; proves who created it
        self.fd = fd  # a memfd's own fd, to pass to the daemon (closed by ``release_fd`` once passed)

    @staticmethod
    def map(fd: int, size: int) -> mmap.mmap:
        """Map ``size`` bytes of ``fd`` and touch every page once, so transfers never pay page faults.
        Only for memory whose pages exist and cannot go away (allocated, and sealed or one's own)."""
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        np.frombuffer(mm, dtype=np.uint8)[::mmap.PAGESIZE] = 0
        return mm

    @classmethod
    def create_sealed(cls, size: int) -> Arena:
        """A memfd of ``size`` bytes, every page allocated, sealed (``SEALS``), holding a random nonce
        at offset 0. OSError when the memory is not there (ENOMEM, ENOSPC): then the stream is used."""
        _check_size(size)
        fd = _memfd()
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # real pages now: nothing is allocated later, on a fault
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls._with_nonce(cls.map(fd, size), "", fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def create(cls, directory: Path, size: int) -> Arena:
        """A new file arena in ``directory`` (mode 0600), every page allocated, holding a random nonce
        at offset 0 (send it with AttachArena). OSError when the directory has no room for it."""
        _check_size(size)
        path = directory / f"kvstore-cli-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not a SIGBUS at the first touch of a hole
            return cls._with_nonce(cls.map(fd, size), str(path))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def _with_nonce(cls, mm: mmap.mmap, path: str, fd: int = -1) -> Arena:
        arena = cls(mm, path, os.urandom(NONCE_BYTES), fd)
        arena.view[:NONCE_BYTES] = arena.nonce
        return arena

    def write(self, off: int, data: Blob) -> None:
        self.view[off : off + len(data)] = data

    def read(self, off: int, n: int) -> bytes:
        return bytes(self.view[off : off + n])

    def contents(self, n: int) -> Blob:
        return self.view[:n]

    def release_fd(self) -> None:
        """Close a memfd's own fd (once the daemon holds its own): the mapping keeps the memory."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def close(self) -> None:
        self.release_fd()
        self.view.release()
        with contextlib.suppress(BufferError):  # views handed out are still alive: they keep the mapping
            self._mm.close()


def _check_size(size: int) -> None:
    if not NONCE_BYTES <= size <= MAX_BYTES:
        raise ValueError(f"arena size must be {NONCE_BYTES} B to {MAX_BYTES} B, got {size}")


def _memfd() -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        return os.memfd_create("kvstore-arena", flags | _MFD_NOEXEC_SEAL)
    except OSError:  # a kernel older than 6.3 does not know the flag
        return os.memfd_create("kvstore-arena", flags)
