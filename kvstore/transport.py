"""Moving chunk blobs over gRPC streams and same-host shared memory (client and daemon share this).

Stream form: the concatenation of chunk blobs, split into messages of at most ``max_bytes``.
Each blob states its own length (docs/FORMAT.md, header offset 8), so no sizes travel beside it,
and the receiver cuts blobs out of each message without copying (memoryview slices) unless a
blob spans messages.

Shared-memory form: one file in ``/dev/shm`` (mode 0600) holding the blobs back to back; the
receiver maps it and deletes it. Only files named ``kvstore-*`` directly inside the shm
directory are ever opened: never through a link, never a FIFO or anything but a regular file
with one name, owned by this process's user (see ``_open_transfer``). The daemon only writes such
files (load answers); it never opens a file a request names, except an arena, whose creator
proves it by the nonce written inside (``Arena.attach``).
"""

from __future__ import annotations

import contextlib
import hmac
import mmap
import os
import re
import stat
import struct
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from kvstore import chunk
from kvstore.errors import InvalidArgument

# data per stream message: under gRPC's default 4 MiB receive limit with room for the message's own
# fields, so a stock client (any language, default options) can read the stream
DEFAULT_MESSAGE_BYTES = (4 << 20) - (128 << 10)
MAX_MESSAGE_BYTES = 16 << 20
_TOTAL = struct.Struct("<I")
_IOV_MAX = 512
_SHM_NAME = re.compile(r"kvstore-(cli|srv)-[0-9a-f]{32}")
NONCE_BYTES = 16
# the start of the daemon's answer to an arena id it does not know, or that another identity
# attached: a client that sees it attaches a fresh arena (the daemon restarted, or dropped it)
UNKNOWN_ARENA = "unknown arena"

Blob = bytes | memoryview


def blob_size(head: Blob) -> int:
    """A chunk's total size from its first 12 bytes (magic checked, so garbage fails fast)."""
    if bytes(head[:4]) != chunk.MAGIC:
        raise InvalidArgument(f"stream does not start a chunk here (magic {bytes(head[:4])!r})")
    return _TOTAL.unpack_from(head, 8)[0]


class BlobAssembler:
    """Cuts a stream of concatenated chunk blobs into blobs, zero-copy where a blob lies in one message."""

    def __init__(self, max_blob: int = chunk.MAX_CHUNK_BYTES) -> None:
        self.max_blob = max_blob
        self._partial: bytearray | None = None  # a blob spanning messages, being filled
        self._filled = 0
        self._head = b""  # fewer than 12 bytes of a blob's header, carried to the next message

    def feed(self, data: bytes | memoryview) -> list[Blob]:
        out: list[Blob] = []
        mv = memoryview(data)
        pos = 0
        while pos < len(mv):
            if self._partial is not None:
                take = min(len(self._partial) - self._filled, len(mv) - pos)
                self._partial[self._filled : self._filled + take] = mv[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled == len(self._partial):
                    out.append(memoryview(self._partial))
                    self._partial = None
                continue
            if self._head or len(mv) - pos < 12:
                need = 12 - len(self._head)
                self._head += bytes(mv[pos : pos + need])
                pos += min(need, len(mv) - pos)
                if len(self._head) < 12:
                    continue
                self._start_partial(self._head)
                self._head = b""
                continue
            size = self._checked_size(mv[pos : pos + 12])
            if len(mv) - pos >= size:
                out.append(mv[pos : pos + size])
                pos += size
            else:
                self._start_partial(mv[pos : pos + 12], copy_from=mv[pos:])
                pos = len(mv)
        return out

    def _checked_size(self, head: Blob) -> int:
        size = blob_size(head)
        if size > self.max_blob:
            raise InvalidArgument(f"chunk of {size} bytes exceeds the {self.max_blob}-byte limit")
        if size < chunk.HEADER_BYTES + chunk.CHECKSUM_BYTES:
            raise InvalidArgument(f"chunk declares {size} bytes, less than a header")
        return size

    def _start_partial(self, head: Blob, copy_from: Blob | None = None) -> None:
        size = self._checked_size(head)
        self._partial = bytearray(size)
        src = copy_from if copy_from is not None else head
        self._partial[: len(src)] = src
        self._filled = len(src)
        if self._filled == size:  # only possible for a 12-byte head that completes nothing; guard anyway
            raise InvalidArgument("chunk shorter than its header")

    def finish(self) -> None:
        if self._partial is not None or self._head:
            raise InvalidArgument("stream ended in the middle of a chunk (truncated)")


def pack(blobs: Iterable[Blob], max_bytes: int = DEFAULT_MESSAGE_BYTES) -> Iterator[tuple[bytes, list[int]]]:
    """Group blobs into messages of at most ``max_bytes`` (a larger blob is split across messages).
    Yields (data, indices of the blobs that start in this message)."""
    parts: list[Blob] = []
    starts: list[int] = []
    size = 0
    for i, blob in enumerate(blobs):
        mv = memoryview(blob)
        starts.append(i)
        while len(mv):
            take = min(len(mv), max_bytes - size)
            parts.append(mv[:take])
            size += take
            mv = mv[take:]
            if size >= max_bytes:
                yield b"".join(parts), starts
                parts, starts, size = [], [], 0
    if parts:
        yield b"".join(parts), starts


# -- shared memory --------------------------------------------------------------------------------
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


def write_shm(directory: Path, blobs: Sequence[Blob], role: str) -> tuple[str, list[int], list[int]]:
    """Write blobs back to back into a new 0600 file; returns (path, offsets, sizes)."""
    sizes = [len(memoryview(b)) for b in blobs]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    path = directory / f"kvstore-{role}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        # writev: the kernel copies straight into the file's pages (no user-space page faults)
        for i in range(0, len(blobs), _IOV_MAX):
            batch = blobs[i : i + _IOV_MAX]
            want = sum(sizes[i : i + _IOV_MAX])
            done = os.writev(fd, batch)
            if done != want:  # a short write: finish this batch byte-exactly
                rest = b"".join(bytes(memoryview(b)) for b in batch)[done:]
                while rest:
                    rest = rest[os.write(fd, rest):]
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return str(path), offsets, sizes


def _open_transfer(path: str, directory: Path, flags: int, what: str, client_only: bool = False) -> int:
    """Open a ``kvstore-*`` file directly inside ``directory``; anything else is refused (a caller
    must not make this process open arbitrary files). The file must be a regular file with one
    name (a hard link could name another user's file), owned by this process's user. O_NONBLOCK:
    opening a FIFO must not block a worker thread until someone writes to it."""
    p = Path(path)
    if (p.parent.resolve() != directory.resolve() or not _SHM_NAME.fullmatch(p.name)
            or (client_only and "-cli-" not in p.name)):
        raise InvalidArgument(f"{what} path {path!r} is not a kvstore {'client' if client_only else 'transfer'} "
                              f"file in {directory}")
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


def open_shm(path: str, directory: Path, expect_size: int | None = None) -> memoryview:
    """Map a transfer file read-only and delete it (the caller now owns it)."""
    p = Path(path)
    fd = _open_transfer(path, directory, os.O_RDONLY, "shared-memory file")
    try:
        size = os.fstat(fd).st_size
        if expect_size is not None and size != expect_size:
            raise InvalidArgument(f"shared-memory file is {size} bytes, expected {expect_size}")
        os.unlink(p)
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def sweep_shm(directory: Path, role: str, older_than_s: float, now: float) -> int:
    """Delete this role's transfer files nobody picked up (a client that died mid-load)."""
    n = 0
    for p in directory.glob(f"kvstore-{role}-*"):
        try:
            if now - p.stat().st_mtime > older_than_s:
                p.unlink()
                n += 1
        except OSError:
            continue
    return n


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
        fd = _open_transfer(path, directory, os.O_RDWR, "arena", client_only=True)
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

    def write(self, blobs: Sequence[Blob]) -> tuple[list[int], list[int]] | None:
        """Copy blobs back to back from offset 0; None if they do not fit."""
        sizes = [len(memoryview(b)) for b in blobs]
        if sum(sizes) > self.size:
            return None
        offsets, off = [], 0
        for b, n in zip(blobs, sizes):
            self.view[off : off + n] = b
            offsets.append(off)
            off += n
        return offsets, sizes

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # views handed out are still alive: they keep the mapping
            self._mm.close()


def _prefault(mm: mmap.mmap) -> None:
    """Touch every page once now, so transfers never pay page faults."""
    np.frombuffer(mm, dtype=np.uint8)[::4096] = 0
