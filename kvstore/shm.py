"""Same-host shared memory: the arena a client creates and the daemon maps, and the guarded open.

An arena is a file in ``/dev/shm`` (mode 0600) that both sides keep mapped: chunk blobs move with one
memcpy into pages already mapped on both sides. ``/dev/shm`` is world-listable, so a name proves
nothing: the daemon maps a file only when the caller sends the random nonce its creator wrote at
offset 0, and only a regular file with one name, directly in the shm directory, named
``kvstore-cli-*``, owned by the daemon's user, opened without following links (``_open_transfer``).
"""

from __future__ import annotations

import contextlib
import hmac
import mmap
import os
import re
import stat
import uuid
from pathlib import Path

import numpy as np

from kvstore.errors import InvalidArgument

_SHM_NAME = re.compile(r"kvstore-cli-[0-9a-f]{32}")
NONCE_BYTES = 16


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


def _open_transfer(path: str, directory: Path, flags: int, what: str) -> int:
    """Open a ``kvstore-*`` file directly inside ``directory``; anything else is refused (a caller
    must not make this process open arbitrary files). The file must be a regular file with one
    name (a hard link could name another user's file), owned by this process's user. O_NONBLOCK:
    opening a FIFO must not block a worker thread until someone writes to it."""
    p = Path(path)
    if p.parent.resolve() != directory.resolve() or not _SHM_NAME.fullmatch(p.name):
        raise InvalidArgument(f"{what} path {path!r} is not a kvstore client file in {directory}")
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgument(f"cannot open {what} {path!r}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{what} {path!r} is not a regular file")
        if st.st_nlink != 1:
            raise InvalidArgument(f"{what} {path!r} has {st.st_nlink} names: a hard link is refused")
        if st.st_uid != os.geteuid():
            raise InvalidArgument(f"{what} {path!r} is not owned by this process's user (uid {os.geteuid()})")
    except BaseException:
        os.close(fd)
        raise
    return fd


class Arena:
    """A shared-memory file both client and daemon keep mapped (same host): chunk blobs move with
    one memcpy into pages that are already mapped on both sides, instead of a new file per call.
    The client creates it and deletes its name once the daemon has attached; the memory lives
    while either side maps it."""

    MAX_BYTES = 4 << 30

    def __init__(self, mm: mmap.mmap, path: str, nonce: bytes = b"") -> None:
        self._mm = mm
        self.view = memoryview(mm)
        self.size = len(mm)
        self.path = path
        self.nonce = nonce  # written at offset 0 by its creator; proves who created it

    @staticmethod
    def _map(fd: int, size: int) -> mmap.mmap:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _prefault(mm)
        return mm

    @classmethod
    def create(cls, directory: Path, size: int) -> Arena:
        """A new arena holding a random nonce at offset 0 (send it with AttachArena)."""
        if not NONCE_BYTES <= size <= cls.MAX_BYTES:
            raise ValueError(f"arena size must be {NONCE_BYTES} B to {cls.MAX_BYTES} B, got {size}")
        path = directory / f"kvstore-cli-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            arena = cls(cls._map(fd, size), str(path), os.urandom(NONCE_BYTES))
            arena.view[:NONCE_BYTES] = arena.nonce
            return arena
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: str, directory: Path, size: int, nonce: bytes) -> Arena:
        """Map a client's arena, if it holds ``nonce`` at offset 0. The nonce is what binds the file
        to the caller: /dev/shm is listable, so a name proves nothing, but only a process that can
        read or write the file knows what its creator wrote in it."""
        if not NONCE_BYTES <= size <= cls.MAX_BYTES:
            raise InvalidArgument(f"arena size must be {NONCE_BYTES} B to {cls.MAX_BYTES} B, got {size}")
        fd = _open_transfer(path, directory, os.O_RDWR, "arena")
        try:
            if len(nonce) != NONCE_BYTES:
                raise InvalidArgument(f"arena nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
            if os.fstat(fd).st_size != size:
                raise InvalidArgument(f"arena {path!r} is {os.fstat(fd).st_size} bytes, not {size}")
            with mmap.mmap(fd, NONCE_BYTES, prot=mmap.PROT_READ) as head:
                if not hmac.compare_digest(head[:NONCE_BYTES], nonce):
                    raise InvalidArgument(f"arena {path!r} does not hold the nonce its creator wrote")
            return cls(cls._map(fd, size), path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # views handed out are still alive: they keep the mapping
            self._mm.close()


def _prefault(mm: mmap.mmap) -> None:
    """Touch every page once now, so transfers never pay page faults."""
    np.frombuffer(mm, dtype=np.uint8)[::4096] = 0
