"""Who sent a request over the daemon's local socket, as the kernel names it on the request's own messages.

A load into the caller's memory (``CallerMemory``: kvstore/transport/cma.py) is written into the
process that sent the request. A socket outlives the process that connected it: a forked child
shares it, SCM_RIGHTS hands it to any process, and once the connecting process exits its pid can
name a new process. So the daemon never writes into a pid remembered at connect; it learns the
sender of each request from the kernel:

- The listening socket asks for ``SO_PASSCRED`` and ``SO_PASSPIDFD`` (accepted sockets inherit
  both, so even bytes sent before the accept are named): the kernel then attaches to every read
  the sender's credentials as of its send (``SCM_CREDENTIALS``: pid, uid, gid) and a pidfd of the
  sending process (``SCM_PIDFD``, Linux 6.5+). A stream socket never joins two senders' bytes in
  one read, so every byte has exactly one sender.
- A call's sender is the one process that sent every byte of it (``Senders``); bytes from two
  processes make a call with no sender. It is kept with the pidfd of its first read: that pidfd
  names the process itself, not a pid number that can be reused.
- The write (``Sender.reaching``) goes to that pid only while the pidfd says the process is alive,
  checked before the write and again after it: while a process lives its pid names nobody else,
  so a write bracketed by two "alive" answers reached the sender.
- Where the kernel has no ``SO_PASSPIDFD`` the pid from ``SCM_CREDENTIALS`` is opened as a pidfd
  (``pidfd_open``) when the write needs it; the pid could then have been reused between the send
  and that open. Where neither names the sender, no write is made.

A call with no sender, or whose sender has exited, is refused as FAILED_PRECONDITION
(``CALLER_MEMORY_REFUSED``: the client then loads through its arena). None of this costs a system
call per chunk: the kernel adds the credentials to reads the daemon makes anyway; the daemon closes
one pidfd per read and polls the pidfd twice per caller-memory call.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
from collections.abc import Iterator
from typing import NamedTuple

from kvstore.errors import FailedPrecondition, Retry

SO_PASSPIDFD = 76  # Linux 6.5+; Python 3.11's socket module lacks the names
SCM_PIDFD = 0x04
_UCRED = struct.Struct("3i")  # pid, uid, gid
_FD = struct.Struct("i")
#: ancillary space a read needs for the sender's credentials and pidfd (beside any SCM_RIGHTS fds)
ANCILLARY_BYTES = socket.CMSG_SPACE(_UCRED.size) + socket.CMSG_SPACE(4)
#: the start of the daemon's answer when it cannot write into the caller (the kernel refuses: another
#: uid, Yama, seccomp; or no one live process sent the request): the client loads through its arena
CALLER_MEMORY_REFUSED = "cannot write into the caller's memory"


def ask_kernel(listener: socket.socket) -> bool:
    """Ask the kernel to name the sender of everything ``listener``'s connections receive: True when it
    attaches a pidfd of the sender too (SO_PASSPIDFD), False when only its credentials."""
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    try:
        listener.setsockopt(socket.SOL_SOCKET, SO_PASSPIDFD, 1)
    except OSError:  # an older kernel: pids only, each opened as a pidfd when a write needs it
        return False
    return True


class Sender(NamedTuple):
    """The process that sent one request over the local socket, or (``pid`` 0) why none can be named.
    ``pidfd``: a pidfd of that process taken from the request's own messages (owned by the connection's
    ``Senders``, valid for the call), or -1 where the kernel gives none."""

    pid: int
    uid: int = -1
    pidfd: int = -1
    unknown: str = ""

    @classmethod
    def unnamed(cls, why: str) -> Sender:
        return cls(0, unknown=why)

    @contextlib.contextmanager
    def reaching(self) -> Iterator[int]:
        """The pid to write into (or read from) on this sender's behalf, for the block; refused
        (FailedPrecondition, CALLER_MEMORY_REFUSED) when no one process sent the request, when it has
        exited, or when it exits during the block (its pid may name another process by then: what
        the block did must not be answered as done)."""
        if not self.pid:
            raise _refused(self.unknown)
        fd, opened = self.pidfd, self.pidfd < 0
        if opened:
            try:
                fd = os.pidfd_open(self.pid)
            except OSError as e:
                raise _refused(f"the process that sent the request (pid {self.pid}) cannot be opened: "
                               f"{e.strerror}") from None
        try:
            if _exited(fd):
                raise _refused(f"the process that sent the request (pid {self.pid}) has exited")
            yield self.pid
            if _exited(fd):
                raise _refused(f"the process that sent the request (pid {self.pid}) exited during the write")
        finally:
            if opened:
                os.close(fd)


class Senders:
    """One connection's senders: each read's ancillary data goes to ``saw``; ``begin`` at each call
    boundary; ``of_call`` is the sender of every byte read since (the call's, and those of a call
    the peer sent before reading the previous answer, if any: one sender for both, or none). Every
    read passes through here: plain ints, no object per read."""

    def __init__(self, pidfds: bool) -> None:
        self.pidfds = pidfds  # the kernel attaches SCM_PIDFD: a read without one names no sender
        # the sender of the reads since ``begin``: pid -1 before the first, 0 when none can be named (``why``)
        self._pid, self._uid, self._pidfd, self._why = -1, -1, -1, ""
        # the previous call's pidfd, closed after the next read: while a pidfd of a process is open the
        # kernel keeps that process's pidfs node, so making and closing the next read's pidfd of the same
        # process adds ~3 us to a read instead of ~12 (Linux 6.18, a C loop of send and recvmsg)
        self._spare = -1

    def saw(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        """The ancillary data of one read that returned bytes: who sent them."""
        pid, uid, pidfd = 0, -1, -1
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET:
                if kind == socket.SCM_CREDENTIALS and len(data) == _UCRED.size:
                    pid, uid, _ = _UCRED.unpack(data)
                elif kind == SCM_PIDFD and len(data) == 4:
                    _close(pidfd)  # the kernel attaches one; a second would be closed, never kept
                    (pidfd,) = _FD.unpack(data)
        if self._spare >= 0:
            _close(self._spare)
            self._spare = -1
        if self._pid < 0:  # the first read since ``begin``: its pidfd stands for the call
            self._name(pid, uid, pidfd)
            return
        _close(pidfd)  # a later read: if the first read's process is alive, this pid is that process
        if self._pid and (pid, uid) != (self._pid, self._uid):
            why = (f"its messages came from more than one process (pids {self._pid} and {pid})" if pid else
                   "the kernel named no sender for part of it")
            self._forget()
            self._pid, self._why = 0, why

    def begin(self, buffered: bool) -> None:
        """A call boundary; ``buffered``: bytes read earlier are still unread (the next call's start)."""
        if not buffered and self._pid >= 0:
            if self._spare >= 0:
                _close(self._spare)
            self._spare, self._pidfd = self._pidfd, -1
            self._pid, self._uid, self._why = -1, -1, ""

    def of_call(self) -> Sender:
        if self._pid > 0:
            return Sender(self._pid, self._uid, self._pidfd)
        return Sender.unnamed(self._why or "the kernel named no sender for this request")

    def close(self) -> None:
        _close(self._spare)
        self._spare = -1
        self._forget()

    def _name(self, pid: int, uid: int, pidfd: int) -> None:
        if pid <= 0:  # no credentials, or a sender outside the daemon's pid namespace (the kernel says 0)
            _close(pidfd)
            self._pid, self._why = 0, "the kernel named no process the daemon can see as this request's sender"
        elif self.pidfds and pidfd < 0:
            self._pid, self._why = 0, f"the kernel gave no pidfd for this request's sender (pid {pid})"
        else:
            self._pid, self._uid, self._pidfd = pid, uid, pidfd

    def _forget(self) -> None:
        _close(self._pidfd)
        self._pid, self._uid, self._pidfd, self._why = -1, -1, -1, ""


def _refused(why: str) -> FailedPrecondition:
    return FailedPrecondition(f"{CALLER_MEMORY_REFUSED}: {why}; load through the arena or the stream instead",
                              reason=Retry.CALLER_MEMORY_REFUSED)


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd polls readable then; zombies too)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _close(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
