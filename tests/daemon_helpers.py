"""Real daemons and synthetic sessions for the server, TLS and CLI tests.

A plain module (not a conftest): tests import what they need. ``start_daemon`` runs
``kvstore serve --port 0`` as a child process and reads the port from the line it
prints when ready; ``make_session`` builds the complete chunks and the manifest of one sequence
with the real chunk codec (and the real FP4 quantizers where the layout uses them).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from kvstore.client import Client
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvstoreError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from kvstore.format import chunk, quant
from kvstore.format.keys import chain_keys
from kvstore.format.layout import EntryFormat, Layout, get_layout
from kvstore.format.manifest import Manifest, Retention
from kvstore.transport import shm
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
READY = "kvstore serving on "
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any KVSTORE_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(extra)
    return env


def kvstore_command() -> list[str]:
    """How to run `kvstore`: the entry point installed beside this interpreter, else its equivalent.
    (Not ``python -m cli.main``: that imports cli.main twice, as __main__ and as cli.main, so the
    CliError a command raises is not the class main() catches, and it escapes as a traceback.)"""
    script = Path(sys.executable).with_name("kvstore")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())"]


def serve_command(data_dir: Path, *flags: str) -> list[str]:
    return [*kvstore_command(), "serve", "--port", "0", "--data-dir", str(data_dir), *flags]


@dataclass
class Daemon:
    """A running ``kvstore serve`` child process."""

    proc: subprocess.Popen[bytes]
    address: str
    data_dir: Path
    log_path: Path  # its stderr (JSON log lines), appended across restarts

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def start_daemon(data_dir: Path, *flags: str, env: dict[str, str] | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> Daemon:
    """Start a daemon on a free loopback port and wait until it prints that it is serving."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.with_name(data_dir.name + ".log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(serve_command(data_dir, *flags), cwd=REPO, env=env or clean_env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
    assert proc.stdout is not None
    lines: queue.Queue[bytes] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        line = lines.get(timeout=timeout_s).decode(errors="replace").strip()
    except queue.Empty:
        line = ""
    if not line.startswith(READY):
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise RuntimeError(f"daemon did not become ready within {timeout_s:.0f}s (exit code {proc.returncode}, "
                           f"stdout {line!r}); stderr:\n{log_path.read_text(errors='replace')[-4000:]}")
    return Daemon(proc, line[len(READY):], data_dir, log_path)


@contextmanager
def running_daemon(data_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    daemon = start_daemon(data_dir, *flags, env=env)
    try:
        yield daemon
    finally:
        daemon.stop()


def transport_stats(d: Daemon) -> pb.TransportStats:
    """How the daemon's calls travelled so far (an admin's Stats, asked over gRPC)."""
    with Client(address=d.address, shared_memory=False) as admin:
        return admin.stats().transport


@contextmanager
def two_daemons(root: Path, *flags: str) -> Iterator[tuple[Daemon, Daemon]]:
    """Daemons A and B with their own data dirs under ``root``, started with the same ``flags``."""
    with running_daemon(root / "a", *flags) as a, running_daemon(root / "b", *flags) as b:
        yield a, b


# -- synthetic sessions ---------------------------------------------------------------------------
def make_entries(layout: Layout, tokens: int, seed: Sequence[int], quantized: bool = True) -> dict[str, chunk.Entries]:
    """Packed entries of every cache of ``layout`` for ``tokens`` tokens, deterministic in ``seed``.
    FP4 caches go through the real quantizers when ``quantized``; other formats get random bytes."""
    rng = np.random.default_rng(list(seed))
    g = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    out = {}
    for c in layout.caches:
        n = c.entries_for(tokens)
        if quantized and c.fmt is EntryFormat.FP4_E4M3_16:
            out[c.name] = chunk.Entries.of(*quant.quantize_main(torch.randn(n, c.channels, generator=g)))
        elif quantized and c.fmt is EntryFormat.FP4_UE8M0_32:
            out[c.name] = chunk.Entries.of(*quant.quantize_indexer(torch.randn(n, c.channels, generator=g)))
        else:
            out[c.name] = chunk.Entries(rng.integers(0, 256, (n, c.code_bytes), dtype=np.uint8),
                                        rng.integers(0, 256, (n, c.scale_bytes), dtype=np.uint8))
    return out


@dataclass(frozen=True)
class SyntheticSession:
    layout: Layout
    token_ids: np.ndarray  # uint32 [tokens]
    chunk_tokens: int
    keys: list[bytes]  # of the complete chunks, in order
    blobs: list[bytes] = field(repr=False)  # the complete chunks, encoded
    manifest: Manifest

    @property
    def namespace(self) -> str:
        return self.manifest.namespace

    @property
    def session_id(self) -> str:
        return self.manifest.session_id

    def with_id(self, session_id: str) -> SyntheticSession:
        """The same sequence under another session id (same chunks, so shared with this one)."""
        m = self.manifest
        return SyntheticSession(self.layout, self.token_ids, self.chunk_tokens, self.keys, self.blobs,
                                Manifest(**{**m.__dict__, "session_id": session_id}))


def make_session(layout: str | Layout = "tiny-16", namespace: str = "ns", session_id: str = "s1",
                 tokens: int = 1000, chunk_tokens: int = 256, seed: int = 0, token_ids: object = None,
                 quantized: bool = True, retention: Retention | None = None,
                 metadata: dict[str, str] | None = None) -> SyntheticSession:
    """A session of ``tokens`` tokens: its complete chunks and a manifest whose trailing span is a
    chunk blob with key ``bytes(16)`` starting at ``n_chunks * chunk_tokens``. A chunk's entries
    depend only on ``seed`` and its index, so sequences with a common prefix share identical chunks."""
    lay = get_layout(layout) if isinstance(layout, str) else layout
    ids = (np.random.default_rng(seed).integers(0, 50_000, tokens) if token_ids is None
           else np.asarray(token_ids)).astype(np.uint32)
    keys = chain_keys(lay.layout_id, namespace, ids, chunk_tokens)
    blobs = []
    for i, key in enumerate(keys):
        lo = i * chunk_tokens
        blobs.append(chunk.encode(lay, key=key, start=lo, token_ids=ids[lo : lo + chunk_tokens],
                                  entries=make_entries(lay, chunk_tokens, (seed, i), quantized)))
    lo = len(keys) * chunk_tokens
    tail = chunk.encode(lay, key=bytes(16), start=lo, token_ids=ids[lo:],
                        entries=make_entries(lay, len(ids) - lo, (seed, len(keys), 1), quantized))
    manifest = Manifest(session_id=session_id, namespace=namespace, layout_id=lay.layout_id,
                        token_count=len(ids), chunk_tokens=chunk_tokens, chunk_keys=tuple(keys), tail=tail,
                        last_token_ids=tuple(int(t) for t in ids[-128:]), retention=retention or Retention(),
                        metadata=dict(metadata or {}))
    return SyntheticSession(lay, ids, chunk_tokens, keys, blobs, manifest)


def save_session(client: Client, s: SyntheticSession) -> Manifest:
    """Save every chunk of ``s`` and commit its manifest, in one call."""
    return client.save_session(s.manifest, s.blobs).manifest


# -- calls that must fail, and same-host arenas ----------------------------------------------------
CODE = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, NotFound: grpc.StatusCode.NOT_FOUND,
        FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED, Unauthenticated: grpc.StatusCode.UNAUTHENTICATED}


def status_of(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call fails with (the client maps each code to one class)."""
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()  # type: ignore[attr-defined]
    except KvstoreError as e:
        return CODE[type(e)], str(e)
    raise AssertionError("the call succeeded")


def attach_arena(stub: pb_grpc.KVStoreStub, size: int = 64 << 10, claimed: int | None = None,
                 metadata: tuple[tuple[str, str], ...] = (), nonce: bytes | None = None) -> str:
    """Create a 64 KiB arena, attach it (claiming ``claimed`` bytes, proving it with ``nonce``,
    by default the one written in it), drop our side; its id."""
    directory = shm.default_shm_dir()
    if directory is None:
        pytest.skip("no writable /dev/shm on this host")
    arena = shm.Arena.create(directory, size)
    try:
        req = pb.AttachArenaRequest(path=arena.path, size=claimed or size,
                                    nonce=arena.nonce if nonce is None else nonce)
        return stub.AttachArena(req, timeout=30, metadata=metadata).arena_id
    finally:
        Path(arena.path).unlink()
        arena.close()
