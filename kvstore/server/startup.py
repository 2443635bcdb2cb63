"""What must hold before a daemon serves: its data dir and its port are its alone.

LMDB does not give the first: it is built for many processes sharing one environment, so a
second daemon on the same data dir opens it happily, runs its startup garbage collection against
the first one's live store, and both then write. gRPC does not give the second: it sets
SO_REUSEPORT by default, so a second daemon on a busy port binds too and the kernel splits
connections between them. Both conditions are refused here, with a one-line reason.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc

LOCK_NAME = "kvstore.lock"
# SO_REUSEPORT off: a bind to a port another process holds must fail, not share it
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class CannotStart(Exception):
    """The daemon must not start; the message says why, in one line."""


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``data_dir`` while the daemon runs. flock: the kernel drops it when
    the process dies, even by SIGKILL, so a crash never leaves a stale lock behind."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds prompt-derived data
    fd = os.open(data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise CannotStart(f"data dir {data_dir} is in use by another kvstore daemon (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``host:port``; the port it got. A busy port (or an address not of this host) is CannotStart,
    saying which."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        got = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc raises "Failed to bind to address ..." on recent versions, saying no more
        got = 0
    if got == 0:  # older grpc versions return 0 instead of raising
        raise CannotStart(f"cannot listen on {address}: {_why_not(host, port)}")
    return got


def _why_not(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound, found by binding it with a plain socket (gRPC does not say)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"{host} does not resolve ({e.strerror})"
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is not busy
            try:
                sock.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"port {port} is in use (another kvstore daemon, or another program)"
                if e.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this host"
                if e.errno == errno.EACCES:
                    return f"permission denied (port {port} needs privileges)"
                return e.strerror or str(e)
    return "gRPC could not bind it (GRPC_VERBOSITY=debug shows its reason)"
