"""Real daemons and synthetic sessions for the server, TLS and CLI tests.

A plain module (not a conftest): tests import what they need. ``start_daemon`` runs
``kvstore serve --port 0`` as a child process through the project's one launcher
(``kvstore.server.process.DaemonProcess``) and returns once it prints that it is ready;
``make_session`` builds the complete chunks and the manifest of one sequence with the real chunk
codec (and the real FP4 quantizers where the layout uses them).
"""

from __future__ import annotations

import socket
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
    ResourceExhausted,
    Unauthenticated,
)
from kvstore.format import chunk, quant
from kvstore.format.keys import chain_keys
from kvstore.format.layout import EntryFormat, Layout, get_layout
from kvstore.format.manifest import Manifest, Retention
from kvstore.server.process import READY, DaemonProcess, Spawner, clean_env, kvstore_command  # noqa: F401 (the tests')
from kvstore.transport import shm
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 20.0
Daemon = DaemonProcess  # a running ``kvstore serve`` child process (kvstore/server/process.py)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(data_dir: Path, *flags: str) -> list[str]:
    """``kvstore serve`` on port 0, for a test that runs it to completion (a daemon that refuses to start)."""
    return [*kvstore_command(), "serve", "--port", "0", "--data-dir", str(data_dir), *flags]


def start_daemon(data_dir: Path, *flags: str, env: dict[str, str] | None = None,
                 timeout_s: float = START_TIMEOUT_S, spawner: Spawner | None = None) -> Daemon:
    """Start a daemon of this tree on a free loopback port (``--port N`` in ``flags`` picks one) with
    JSON log lines appended to ``<data_dir>.log`` across restarts, and wait until it is serving."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return DaemonProcess(data_dir, flags, env=env or clean_env(), cwd=REPO, spawner=spawner,
                         log_path=data_dir.with_name(data_dir.name + ".log"), log_format=None,
                         start_timeout_s=timeout_s).start()


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
        PermissionDenied: grpc.StatusCode.PERMISSION_DENIED, Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
        ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED}


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
