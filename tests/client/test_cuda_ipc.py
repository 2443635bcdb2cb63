"""The same-GPU handoff with two real processes: a ``kvstore serve`` daemon with an HBM tier, and
this test process as the model process. Chunks must arrive bit-exact on the device, through CUDA
IPC where the machine allows it, else (and whenever negotiation says no) through the host path.

The host-path fallback runs everywhere (device "cpu"); the rest needs CUDA. Where CUDA IPC itself
is refused (e.g. a sandbox such as gVisor), the IPC test checks the fallback delivered the chunks
and then skips, printing why, rather than passing as if IPC had been exercised."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.client import Client, device_load
from kvstore.client.device_load import HOST, IPC
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.format import chunk
from kvstore.server.device_arenas import MAX_PER_OWNER, DeviceArenas
from kvstore.store import SessionStore, StoreConfig, TieredStore
from kvstore.tiers import HostTierConfig, SsdTierConfig, make_tier
from kvstore.tiers.device_tier import DeviceTier
from kvstore.tiers.host.tier import HostTier
from kvstore.v1 import kvstore_pb2 as pb
from tests.helpers.daemon import Daemon, make_session, running_daemon, save_session

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="the same-GPU handoff needs CUDA")


@pytest.fixture
def hbm_daemon(tmp_path: Path) -> Iterator[Daemon]:
    if not CUDA:
        pytest.skip("an HBM tier needs CUDA")
    with running_daemon(tmp_path / "data", "--hbm-capacity-bytes", str(64 << 20)) as d:
        yield d


def _check(chunks: list[tuple[int, torch.Tensor]], blobs: list[bytes], device: torch.device) -> None:
    assert [i for i, _ in chunks] == list(range(len(blobs)))
    for (_, t), blob in zip(chunks, blobs):
        assert t.device == device and t.dtype == torch.uint8
        assert t.cpu().numpy().tobytes() == blob


def test_host_path_when_the_device_is_not_cuda(tmp_path: Path) -> None:
    s = make_session(tokens=1500, chunk_tokens=256)
    with running_daemon(tmp_path / "data") as d, Client(address=f"127.0.0.1:{d.port}") as c:
        save_session(c, s)
        manifest, chunks = c.load_session_to_device(s.namespace, s.session_id, device="cpu")
        assert manifest.chunk_keys == s.manifest.chunk_keys
        _check(chunks, s.blobs, torch.device("cpu"))
        loader = c.device_loader("cpu")
        assert loader.path == HOST and loader.reason == "no CUDA device here"


@needs_cuda
def test_host_path_when_the_daemon_has_no_hbm_tier(tmp_path: Path) -> None:
    s = make_session(tokens=800, chunk_tokens=256)
    dev = torch.device("cuda", torch.cuda.current_device())
    with running_daemon(tmp_path / "data") as d, Client(address=f"127.0.0.1:{d.port}") as c:
        save_session(c, s)
        _, chunks = c.load_session_to_device(s.namespace, s.session_id, device=dev)
        _check(chunks, s.blobs, dev)
        assert c.device_loader(dev).path == HOST and c.device_loader(dev).reason == "the daemon has no HBM tier"


def test_ipc_handoff_between_two_processes(hbm_daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_load, "MIN_BUFFER_BYTES", 4096)  # too small: the daemon asks for more
    s = make_session(tokens=3000, chunk_tokens=256, seed=3)
    other = make_session(tokens=1200, chunk_tokens=256, seed=4, session_id="s2")
    dev = torch.device("cuda", torch.cuda.current_device())
    with Client(address=f"127.0.0.1:{hbm_daemon.port}") as c:
        save_session(c, s)
        save_session(c, other)
        manifest, chunks = c.load_session_to_device(s.namespace, s.session_id, device=dev)
        assert manifest.chunk_keys == s.manifest.chunk_keys
        _check(chunks, s.blobs, dev)
        loader = c.device_loader(dev)
        print(f"same-GPU handoff path: {loader.path} {loader.reason}")
        if loader.path != IPC:  # the fallback delivered; say plainly that IPC was not exercised
            assert loader.reason
            pytest.skip(f"CUDA IPC unavailable on this machine, host path used: {loader.reason}")
        first = loader._buffer
        _, again = c.load_session_to_device(other.namespace, other.session_id, device=dev)
        _check(again, other.blobs, dev)
        assert loader._buffer is first  # the buffer (and the daemon's mapping of it) is reused


def test_attach_refuses_another_gpu_and_unknown_buffers(hbm_daemon: Daemon) -> None:
    with Client(address=f"127.0.0.1:{hbm_daemon.port}") as c:
        forged = pb.DeviceBufferHandle(gpu_uuid="GPU-00000000-0000-0000-0000-000000000000", handle=bytes(64),
                                       storage_bytes=4096, size=4096)
        with pytest.raises(FailedPrecondition, match="host path"):
            c.attach_device_buffer(forged)
        with pytest.raises(InvalidArgument, match="unknown device buffer"):
            c.load_session_into_device_buffer("ns", "s1", "made-up")


class _CpuHbm(HostTier, DeviceTier):
    """A host tier posing as the HBM tier (``copy_to`` into a CPU tensor): the daemon's load logic
    (device_arenas.py) tested on any machine; the real device copies are tested above."""

    name = "hbm"
    device = torch.device("cpu")

    def copy_to(self, keys: list[bytes], dst: torch.Tensor, offsets: list[int]) -> list[bool]:
        out = []
        for key, at in zip(keys, offsets):
            value = self.get_many([key])[0]
            if value is not None:
                dst[at:at + len(value)] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
            out.append(value is not None)
        return out


def test_device_arena_loads_without_a_gpu(tmp_path: Path) -> None:
    ssd = SsdTierConfig(path=str(tmp_path / "ssd"))
    cfg = StoreConfig(tiers=(HostTierConfig(pin_memory=False), ssd), chunk_tokens=256)
    fast = _CpuHbm(HostTierConfig(pin_memory=False))
    sessions = SessionStore(TieredStore([fast, make_tier(ssd, compressible_from=chunk.compressible_offset)], cfg), cfg)
    try:
        s = make_session(tokens=3000, chunk_tokens=256, seed=5)
        sessions.save_chunks(s.namespace, s.manifest.layout_id, bytes(16), 0, s.blobs)
        sessions.commit(s.manifest)
        arenas = DeviceArenas(sessions)
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        bid = arenas.add_opened("me", buf)

        def load_and_check(expect_device: int) -> None:
            buf.zero_()
            r = arenas.load("me", s.namespace, s.session_id, bid)
            assert r.device_chunks == expect_device and not r.needed_bytes
            assert [c.index for c in r.chunks] == list(range(len(s.blobs)))
            for c, blob in zip(r.chunks, s.blobs):
                assert c.offset % 256 == 0 and buf[c.offset:c.offset + c.size].numpy().tobytes() == blob

        load_and_check(len(s.blobs))
        for k in s.keys[::2]:  # demoted out of the fast tier: read through the host path, uploaded
            fast.delete_many([k])
        load_and_check(len(s.blobs) - len(s.keys[::2]))
        small = arenas.add_opened("me", torch.zeros(1000, dtype=torch.uint8))
        r = arenas.load("me", s.namespace, s.session_id, small)
        assert r.needed_bytes >= sum(len(b) for b in s.blobs) and not r.chunks
        with pytest.raises(InvalidArgument):
            arenas.load("someone else", s.namespace, s.session_id, bid)  # another token's id: unknown
        with pytest.raises(NotFound):
            arenas.load("me", "other-ns", s.session_id, bid)
        assert not arenas.detach("someone else", bid) and arenas.detach("me", bid)
        with pytest.raises(InvalidArgument):
            arenas.load("me", s.namespace, s.session_id, bid)
        ids = [arenas.add_opened("me", torch.zeros(16, dtype=torch.uint8)) for _ in range(MAX_PER_OWNER + 1)]
        assert not arenas.detach("me", small) and not arenas.detach("me", ids[0])  # the oldest were closed
        assert len(arenas) == MAX_PER_OWNER
    finally:
        sessions.store.close()
