"""The device loader's host path on a real daemon: ``load_session_into`` one host buffer the loader keeps
(the daemon writes the chunks there itself over the local socket; over gRPC they are copied in), grown
from the session's manifest when a session needs more, then one upload into a device buffer the loader
also keeps. The CPU device runs everywhere; the CUDA half (page-locked buffer, the upload) needs a GPU.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstore.client import Client, device_load
from kvstore.client.device_load import HOST, DeviceLoader
from kvstore.cuda.pinned import GRANULE, HostBuffer
from kvstore.format.manifest import Manifest
from kvstore.transport import shm
from tests.helpers.daemon import Daemon, SyntheticSession, make_session, running_daemon, save_session, transport_stats

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="the upload to a CUDA device needs CUDA")
pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("device-load") / "data") as d:
        yield d


@pytest.fixture(autouse=True)
def small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_load, "MIN_BUFFER_BYTES", 4096)  # sized by the sessions, not the floor


def sessions(ns: str) -> tuple[SyntheticSession, SyntheticSession]:
    """A small session and one whose chunks need a larger buffer than the first one's."""
    return (make_session(namespace=ns, session_id="small", tokens=1300, seed=1),
            make_session(namespace=ns, session_id="large", tokens=256 * 60, seed=2))


def counted(c: Client) -> list[int]:
    """How many ``load_session_into`` calls the loader made through ``c`` (one list item, counting)."""
    calls, real = [0], c.load_session_into

    def spy(namespace: str, session_id: str, out: Any) -> tuple[Manifest, list[tuple[int, memoryview]]]:
        calls[0] += 1
        return real(namespace, session_id, out)

    c.load_session_into = spy  # type: ignore[method-assign]
    return calls


def check(chunks: list[tuple[int, torch.Tensor]], s: SyntheticSession, device: torch.device) -> None:
    assert [i for i, _ in chunks] == list(range(len(s.blobs)))
    for (_, t), blob in zip(chunks, s.blobs):
        assert t.device == device and t.dtype == torch.uint8
        assert t.cpu().numpy().tobytes() == blob


def host_path_loads(daemon: Daemon, device: torch.device, shared_memory: bool = True) -> None:
    """Small, large, small again: each bit-exact; the host buffer grows once, for the large one, and is
    kept; the daemon wrote into it itself (same host, local socket) or not at all (gRPC)."""
    ns = f"d-{uuid.uuid4().hex[:12]}"
    small, large = sessions(ns)
    with Client(address=daemon.address) as c:
        save_session(c, small)
        save_session(c, large)
    with Client(address=daemon.address, shared_memory=shared_memory) as c:
        loader, calls = c.device_loader(device), counted(c)
        before = transport_stats(daemon).caller_memory_calls
        m, chunks = c.load_session_to_device(ns, "small", device=device)
        assert loader.path == HOST and m.chunk_keys == small.manifest.chunk_keys
        check(chunks, small, device)
        first = loader._host
        assert first is not None and sum(map(len, small.blobs)) <= first.size < sum(map(len, large.blobs))
        _, chunks = c.load_session_to_device(ns, "large", device=device)
        check(chunks, large, device)
        grown = loader._host
        assert grown is not None and grown is not first and grown.size >= sum(map(len, large.blobs))
        _, chunks = c.load_session_to_device(ns, "small", device=device)
        check(chunks, small, device)
        assert loader._host is grown  # kept: a smaller session reuses the larger buffer
        assert calls[0] == 4  # 3 loads + the large one's first try, refused: the buffer was too small
        writes = transport_stats(daemon).caller_memory_calls - before
        assert writes == (3 if shared_memory else 0)  # the daemon wrote into it itself, or (gRPC) did not
    assert loader._host is None  # closed with the client


def test_host_path_into_one_kept_buffer_grown_for_a_larger_session(daemon: Daemon) -> None:
    host_path_loads(daemon, torch.device("cpu"))


def test_host_path_over_grpc_copies_in_the_same_way(daemon: Daemon) -> None:
    host_path_loads(daemon, torch.device("cpu"), shared_memory=False)


def test_views_are_of_the_kept_buffer_and_valid_until_the_next_load(daemon: Daemon) -> None:
    ns = f"d-{uuid.uuid4().hex[:12]}"
    small, large = sessions(ns)
    with Client(address=daemon.address) as c:
        save_session(c, large)
        save_session(c, small)
        _, a = c.load_session_to_device(ns, "small", device="cpu")
        held = c.device_loader("cpu")._host
        assert held is not None
        base = held.tensor.data_ptr()
        offsets = [t.data_ptr() - base for _, t in a]
        assert offsets == [sum(map(len, small.blobs[:i])) for i in range(len(small.blobs))]  # packed in order
        _, b = c.load_session_to_device(ns, "large", device="cpu")  # grows: the old views keep their memory
        assert bytes(a[0][1].numpy()) == small.blobs[0]
        _, b = c.load_session_to_device(ns, "large", device="cpu")
        assert b[0][1].data_ptr() == c.device_loader("cpu")._host.tensor.data_ptr()  # type: ignore[union-attr]


def test_host_buffer_rounds_up_and_is_plain_memory_without_cuda() -> None:
    b = HostBuffer(GRANULE + 1, pin=False)
    assert b.size == 2 * GRANULE and b.tensor.numel() == b.size and not b.pinned
    b.tensor[-1] = 7
    view = b.tensor[-4:]
    b.close()
    assert int(view[-1]) == 7  # the memory lives as long as a view of it


@needs_cuda
def test_host_path_to_a_cuda_device_uploads_from_a_page_locked_buffer(daemon: Daemon) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    host_path_loads(daemon, dev)


@needs_cuda
def test_the_device_buffer_is_kept_and_the_host_buffer_registered(daemon: Daemon) -> None:
    ns = f"d-{uuid.uuid4().hex[:12]}"
    small, _ = sessions(ns)
    dev = torch.device("cuda", torch.cuda.current_device())
    with Client(address=daemon.address) as c:
        save_session(c, small)
        loader = DeviceLoader(c, dev, ipc=False)
        _, a = loader.load(ns, "small")
        assert loader.path == HOST and loader.reason == "the host path was asked for"
        assert loader._host is not None and loader._host.pinned
        staged = loader._staged
        _, b = loader.load(ns, "small")
        assert loader._staged is staged and b[0][1].data_ptr() == a[0][1].data_ptr()
        check(b, small, dev)
        loader.close()


@needs_cuda
def test_a_registered_buffer_uploads_asynchronously_and_exactly() -> None:
    b = HostBuffer(3 * GRANULE, pin=True)
    assert b.pinned and b.tensor.is_pinned()
    b.tensor.copy_(torch.randint(0, 256, (b.size,), dtype=torch.uint8))
    out = torch.empty(b.size, dtype=torch.uint8, device="cuda")
    out.copy_(b.tensor, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), b.tensor)
    b.close()
    assert not b.pinned


def test_loader_sizes_its_first_buffer_from_the_manifest(daemon: Daemon) -> None:
    ns = f"d-{uuid.uuid4().hex[:12]}"
    _, large = sessions(ns)
    with Client(address=daemon.address) as c:
        save_session(c, large)
        calls = counted(c)
        _, chunks = c.load_session_to_device(ns, "large", device="cpu")
        check(chunks, large, torch.device("cpu"))
        assert calls[0] == 1  # no refused first try


@needs_cuda
def test_host_path_from_a_daemons_hbm_tier(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The daemon's batch read out of its HBM tier (HbmTier.read_views), into this process's kept
    buffer, uploaded: bit-exact, and every chunk was in the HBM tier."""
    ns = f"d-{uuid.uuid4().hex[:12]}"
    small, large = sessions(ns)
    dev = torch.device("cuda", torch.cuda.current_device())
    data = tmp_path_factory.mktemp("device-load-hbm") / "data"
    with running_daemon(data, "--hbm-capacity-bytes", str(64 << 20)) as d, Client(address=d.address) as c:
        save_session(c, small)
        save_session(c, large)
        assert c.get_session(ns, "large")[1] == {"hbm": len(large.blobs)}
        loader = DeviceLoader(c, dev, ipc=False)
        for s in (large, small, large):
            _, chunks = loader.load(ns, s.manifest.session_id)
            check(chunks, s, dev)
        loader.close()
