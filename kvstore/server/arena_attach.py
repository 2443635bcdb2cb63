"""How the daemon takes hold of a client's arena: never in a way the client can turn into a SIGBUS.

A mapping of memory whose owner can shrink it faults when touched past the new end (SIGBUS): a
client running as the daemon's user could kill the daemon, for every tenant, by truncating its
arena file, and a sparse file larger than the free space of ``/dev/shm`` faults the same way once
its holes are touched. So the daemon maps only memory that cannot shrink, and checks the space:

- ``attach_sealed``: a memfd handed over the local socket (SCM_RIGHTS). It must be sealed against
  shrinking (F_SEAL_SHRINK: nobody, its creator included, can truncate it any more), live on the
  kernel's internal tmpfs (no size limit of its own; not hugetlbfs, whose pool can run dry on a
  fault), be exactly the size claimed and have every page allocated. Then it is mapped.
- ``attach_file``: a ``kvstore-cli-*`` file in ``/dev/shm`` named by path (AttachArena over gRPC,
  as any stock client can). Its owner can truncate it or punch holes in it at any time, so it is
  never mapped: the daemon keeps an fd and moves bytes with pread/pwrite (``FileArena``), which
  turn a truncated file or a full ``/dev/shm`` into an error status for that one call. It must be
  fully allocated when attached (a sparse file is refused: its holes may have no room behind them).

In both, the caller proves it created the arena with the nonce written at offset 0, read with
pread (nothing is mapped before every check passed).
"""

from __future__ import annotations

import ctypes
import fcntl
import hmac
import os
import re
import stat
import struct
from pathlib import Path

from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.transport import shm
from kvstore.transport.framing import Blob

_SHM_NAME = re.compile(r"kvstore-cli-[0-9a-f]{32}")
TMPFS_MAGIC = 0x01021994  # statfs.f_type of tmpfs and of the internal mount memfds live on
HUGETLBFS_MAGIC = 0x958458F6
SHOWN_PATH = 120  # at most this many characters of a path are quoted in a message


def shown(path: str) -> str:
    """``path`` quoted for a message, cut to ``SHOWN_PATH`` characters (a path is client input)."""
    return repr(path if len(path) <= SHOWN_PATH else path[:SHOWN_PATH] + "...")


# -- a sealed memfd: mapped ---------------------------------------------------------------------------
def attach_sealed(fd: int, size: int, nonce: bytes) -> shm.Arena:
    """Map the memfd ``fd`` (a client passed it; this call owns it and closes it) once it has passed
    every check in the module docstring."""
    try:
        _check_size(size)
        _check_nonce_length(nonce)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument("the fd passed with AttachArena is not a memfd: not a regular file")
        magic = _fs_magic(fd)
        if magic != TMPFS_MAGIC:
            kind = "a hugetlbfs memfd" if magic == HUGETLBFS_MAGIC else f"on a filesystem of type {magic:#x}"
            raise InvalidArgument(f"the fd passed with AttachArena is {kind}, not a memfd on tmpfs")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise InvalidArgument("the fd passed with AttachArena is not a sealable memfd "
                                  "(memfd_create with MFD_ALLOW_SEALING)") from None
        if not seals & shm.SEAL_SHRINK:
            raise InvalidArgument("the memfd passed with AttachArena is not sealed against shrinking "
                                  "(fcntl F_ADD_SEALS F_SEAL_SHRINK): a client could truncate it under the mapping")
        _check_file(st, size, "the memfd")
        _check_nonce(fd, nonce, "the memfd")
        try:
            return shm.Arena(shm.Arena.map(fd, size))
        except OSError as e:  # sealed against writing (F_SEAL_WRITE), say
            raise InvalidArgument(f"the memfd passed with AttachArena cannot be mapped for writing: {e.strerror}"
                                  ) from None
    finally:
        os.close(fd)


def _fs_magic(fd: int) -> int:
    """``fstatfs(fd).f_type`` (os has no fstatfs): which filesystem the file lives on."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type (a long) comes first
    if libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise InvalidArgument(f"the fd passed with AttachArena cannot be inspected: {os.strerror(err)}")
    return int(struct.unpack_from("l", buf)[0]) & 0xFFFFFFFF


# -- a file named by path: read and written through an fd, never mapped ---------------------------------
class FileArena(shm.ArenaMemory):
    """A client's ``/dev/shm`` file as the daemon holds it: an fd, pread and pwrite. A file its owner
    truncated, or a write that finds ``/dev/shm`` full, fails that call with FAILED_PRECONDITION."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def write(self, off: int, data: Blob) -> None:
        try:
            if os.fstat(self.fd).st_size < off + len(data):
                raise _unusable("it was truncated")
            if os.pwrite(self.fd, data, off) != len(data):
                raise _unusable("a short write")
        except OSError as e:
            raise _unusable(e.strerror or str(e)) from None

    def read(self, off: int, n: int) -> bytes:
        try:
            data = os.pread(self.fd, n, off)
        except OSError as e:
            raise _unusable(e.strerror or str(e)) from None
        if len(data) != n:
            raise _unusable("it was truncated")
        return data

    def contents(self, n: int) -> Blob:
        return self.read(0, n)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _unusable(why: str) -> FailedPrecondition:
    return FailedPrecondition(f"the arena file cannot be used: {why}; attach a new arena")


def attach_file(path: str, directory: Path, size: int, nonce: bytes) -> FileArena:
    """Hold a client's arena file, if it holds ``nonce`` at offset 0 (``/dev/shm`` is listable, so a
    name proves nothing; only a process that can read the file knows what its creator wrote)."""
    _check_size(size)
    fd = open_transfer(path, directory, os.O_RDWR, "arena")
    try:
        _check_nonce_length(nonce)
        _check_file(os.fstat(fd), size, f"arena {shown(path)}")
        _check_nonce(fd, nonce, f"arena {shown(path)}")
    except BaseException:
        os.close(fd)
        raise
    return FileArena(fd, size)


def open_transfer(path: str, directory: Path, flags: int, what: str) -> int:
    """Open a ``kvstore-cli-*`` file directly inside ``directory``; anything else is refused (a caller
    must not make this process open arbitrary files). The file must be a regular file with one
    name (a hard link could name another user's file), owned by this process's user. O_NONBLOCK:
    opening a FIFO must not block a worker thread until someone writes to it."""
    if "\0" in path:
        raise InvalidArgument(f"{what} path {shown(path)} contains a NUL byte")
    p = Path(path)
    if not _SHM_NAME.fullmatch(p.name) or not _directly_in(p, directory):
        raise InvalidArgument(f"{what} path {shown(path)} is not a kvstore client file in {directory}")
    try:
        fd = os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgument(f"cannot open {what} {shown(path)}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"{what} {shown(path)} is not a regular file")
        if st.st_nlink != 1:
            raise InvalidArgument(f"{what} {shown(path)} has {st.st_nlink} names: a hard link is refused")
        if st.st_uid != os.geteuid():
            raise InvalidArgument(f"{what} {shown(path)} is not owned by this process's user (uid {os.geteuid()})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _directly_in(p: Path, directory: Path) -> bool:
    try:
        return p.parent.resolve() == directory.resolve()
    except (OSError, RuntimeError):  # a parent that cannot be resolved (too long, a symlink loop) is not it
        return False


# -- checks both kinds share ------------------------------------------------------------------------------
def _check_size(size: int) -> None:
    if not shm.NONCE_BYTES <= size <= shm.MAX_BYTES:
        raise InvalidArgument(f"arena size must be {shm.NONCE_BYTES} B to {shm.MAX_BYTES} B, got {size}")


def _check_nonce_length(nonce: bytes) -> None:
    if len(nonce) != shm.NONCE_BYTES:
        raise InvalidArgument(f"arena nonce must be {shm.NONCE_BYTES} bytes, got {len(nonce)}")


def _check_file(st: os.stat_result, size: int, what: str) -> None:
    if st.st_size != size:
        raise InvalidArgument(f"{what} is {st.st_size} bytes, not {size}")
    if st.st_blocks * 512 < size:  # holes: touching them allocates, and there may be no room for that
        raise InvalidArgument(f"{what} is sparse ({st.st_blocks * 512} of {size} bytes allocated): allocate "
                              "every page before attaching it (fallocate); a too small /dev/shm cannot")


def _check_nonce(fd: int, nonce: bytes, what: str) -> None:
    try:
        head = os.pread(fd, shm.NONCE_BYTES, 0)
    except OSError as e:
        raise InvalidArgument(f"{what} cannot be read: {e.strerror}") from None
    if not hmac.compare_digest(head, nonce):
        raise InvalidArgument(f"{what} does not hold the nonce its creator wrote")
