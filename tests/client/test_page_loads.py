"""Engine pages loaded into their slots (``Client.load_pages_into``) on a real daemon: over the local
socket the daemon writes each verified page blob's payload, the engine's block bytes, at its key's
slot of the caller's region (process_vm_writev), and nothing else; elsewhere the client loads through
its arena or the stream and copies the payloads in the same way."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client import AsyncClient, Client, PageLoad, PageSlots
from kvstore.errors import InvalidArgument
from kvstore.format import page
from kvstore.format.manifest import Kind, Manifest, Retention
from kvstore.format.page_layout import PageLayout
from kvstore.server.process import Exec, kvstore_command
from kvstore.transport import local_channel, shm
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers.daemon import Daemon, running_daemon, start_daemon, transport_stats
from tests.helpers.pages import v41_layout

pytestmark = pytest.mark.skipif(shm.default_shm_dir() is None, reason="no writable /dev/shm on this host")

LAYOUT: PageLayout = v41_layout()  # groups of 136,704 and 91,136 B
STRIDE = 140000  # the engine's slot: its block stride, padded past the largest group's pages
FILL = 0xAA


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with running_daemon(tmp_path_factory.mktemp("pages") / "data") as d:
        yield d


@pytest.fixture
def ns() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


def block(group: int, seed: int) -> bytes:
    g = LAYOUT.group(group)
    assert g is not None
    return np.random.default_rng((seed, group)).integers(0, 256, g.block_bytes, dtype=np.uint8).tobytes()


def saved(c: Client, ns: str, n: int, sid: str = "s") -> tuple[list[bytes], list[bytes], list[bytes]]:
    """``n`` blocks (groups 0 and 1 in turn) saved as one page session: their keys, blobs and block bytes."""
    keys, blobs, blocks = [], [], []
    for i in range(n):
        g, h = i % 2, f"{ns}/{i}".encode()
        key = page.page_key(LAYOUT.layout_id, ns, g, h)
        keys.append(key)
        blocks.append(block(g, i))
        blobs.append(page.encode(LAYOUT, g, h, key, blocks[-1]))
    c.register_layout(LAYOUT.definition())
    c.save_session(Manifest(sid, ns, LAYOUT.layout_id, 256 * n, 0, tuple(keys), b"", (),
                            retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES), blobs)
    return keys, blobs, blocks


def region(slots: int) -> np.ndarray:
    return np.full(slots * STRIDE, FILL, np.uint8)


def assert_slots(out: np.ndarray, offsets: list[int], blocks: list[bytes | None]) -> None:
    """Each slot holds its block then the fill (None: the fill only), and so does every byte between slots."""
    want = np.full(len(out), FILL, np.uint8)
    for off, b in zip(offsets, blocks):
        if b is not None:
            want[off : off + len(b)] = np.frombuffer(b, np.uint8)
    assert (out == want).all()


def test_the_daemon_writes_each_block_into_its_slot_and_nothing_else(daemon: Daemon, ns: str) -> None:
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 6)
        out = region(8)
        offsets = [STRIDE * s for s in (5, 0, 7, 2, 3, 6)]  # scattered, two slots left free
        before = transport_stats(daemon).caller_memory_calls
        placed = c.load_pages_into(ns, keys, out, offsets, STRIDE)
        assert transport_stats(daemon).caller_memory_calls == before + 1  # written by the daemon
    assert [i for i, _ in placed] == list(range(6)) and [bytes(v) for _, v in placed] == blocks
    assert all(np.shares_memory(np.frombuffer(v, np.uint8), out) for _, v in placed)
    assert_slots(out, offsets, blocks)


def test_a_missing_key_and_another_tenants_key_leave_their_slots_untouched(daemon: Daemon, ns: str) -> None:
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 3)
        other_keys, _, _ = saved(c, ns + "-b", 1)
        out = region(5)
        ask = [keys[0], bytes(16), other_keys[0], keys[2], keys[1]]
        offsets = [STRIDE * s for s in range(5)]
        placed = c.load_pages_into(ns, ask, out, offsets, STRIDE)
        assert [i for i, _ in placed] == [0, 3, 4]
        assert_slots(out, offsets, [blocks[0], None, None, blocks[2], blocks[1]])
        nothing = region(1)  # a load that finds nothing is answered (no second load through the arena)
        assert c.load_pages_into(ns, [bytes(16)], nothing, [0], STRIDE) == [] and (nothing == FILL).all()


@pytest.mark.parametrize("case", ["past the end", "overlapping", "one short", "no slot bytes", "huge offset"])
def test_slots_outside_the_region_are_invalid_argument_before_any_write(daemon: Daemon, ns: str, case: str) -> None:
    """The daemon checks the slots a request names before it reads or writes anything (the client
    checks them too: here the raw request goes to the daemon's local socket)."""
    with Client(address=daemon.address) as c:
        keys, _, _ = saved(c, ns, 2)
        info = c.info()
    out = region(2)
    slots, size, slot_bytes = {
        "past the end": ([0, STRIDE + 1], len(out), STRIDE), "overlapping": ([0, STRIDE - 1], len(out), STRIDE),
        "one short": ([0], len(out), STRIDE), "no slot bytes": ([0, STRIDE], len(out), 0),
        "huge offset": ([0, (1 << 64) - 1], len(out), STRIDE)}[case]
    into = pb.CallerMemory(address=out.ctypes.data, size=size, slot_offsets=slots, slot_bytes=slot_bytes)
    local = local_channel.LocalChannel(info.local_socket)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.KVStoreStub(local).LoadChunks(pb.LoadChunksRequest(namespace=ns, keys=keys, into=into)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "CallerMemory.slot" in e.value.details()
    finally:
        local.close()
    assert (out == FILL).all()
    with Client(address=daemon.address) as c, pytest.raises(InvalidArgument, match=r"CallerMemory\.slot"):
        c.load_pages_into(ns, keys, out, slots, slot_bytes)  # the client's own check, before any call


def test_slots_too_small_for_a_block_are_invalid_argument_before_any_write(daemon: Daemon, ns: str) -> None:
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 2)
        small = len(blocks[1])  # group 1's block fits, group 0's does not
        out = np.full(2 * small, FILL, np.uint8)
        with pytest.raises(InvalidArgument, match="slot_bytes"):
            c.load_pages_into(ns, [keys[1], keys[0]], out, [0, small], small)
    assert (out == FILL).all()  # not even the block that fits


def test_a_load_session_names_no_slots(daemon: Daemon, ns: str) -> None:
    with Client(address=daemon.address) as c:
        saved(c, ns, 1)
        info = c.info()
    out = region(1)
    into = pb.CallerMemory(address=out.ctypes.data, size=len(out), slot_offsets=[0], slot_bytes=STRIDE)
    local = local_channel.LocalChannel(info.local_socket)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.KVStoreStub(local).LoadSession(pb.LoadSessionRequest(namespace=ns, session_id="s", into=into)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "only LoadChunks" in e.value.details()
    finally:
        local.close()


def test_without_the_local_socket_the_client_copies_the_blocks_in_the_same_way(daemon: Daemon, ns: str) -> None:
    """A daemon on another host (here: a client that does not use the local socket): the blobs come
    on the stream, are checked again and their payloads copied into the same slots."""
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 4)
    out, offsets = region(5), [STRIDE * s for s in (4, 1, 0, 3)]
    with Client(address=daemon.address, shared_memory=False) as far:
        before = transport_stats(daemon).caller_memory_calls
        placed = far.load_pages_into(ns, [*keys, bytes(16)], out, [*offsets, 2 * STRIDE], STRIDE)
        assert transport_stats(daemon).caller_memory_calls == before
    assert [i for i, _ in placed] == [0, 1, 2, 3] and [bytes(v) for _, v in placed] == blocks
    assert_slots(out, [*offsets, 2 * STRIDE], [*blocks, None])


def test_the_async_face_loads_pages_the_same_way(daemon: Daemon, ns: str) -> None:
    import asyncio

    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 2)
    out = region(2)

    async def go() -> list[tuple[int, memoryview]]:
        async with AsyncClient(address=daemon.address) as a:
            return await a.load_pages_into(ns, keys, out, [STRIDE, 0], STRIDE)

    assert [i for i, _ in asyncio.run(go())] == [0, 1]
    assert_slots(out, [STRIDE, 0], blocks)


def _flip_in_file(data_dir: Path, needle: bytes) -> None:
    """Flip one byte of the stored copy of ``needle`` (a run of a block's bytes) in the daemon's files."""
    for path in sorted(p for p in data_dir.rglob("*") if p.is_file()):
        raw = bytearray(path.read_bytes())
        at = raw.find(needle)
        if at >= 0:
            raw[at + len(needle) // 2] ^= 0x40
            path.write_bytes(bytes(raw))
            return
    raise AssertionError("the block's bytes are in no file of the daemon's")


def test_a_corrupted_block_is_a_miss_and_its_slot_untouched(tmp_path: Path, ns: str) -> None:
    data = tmp_path / "data"
    d = start_daemon(data)
    try:
        with Client(address=d.address) as c:
            keys, _, blocks = saved(c, ns, 3)
        assert d.stop() == 0
        _flip_in_file(data, blocks[1][5000:5064])  # the ssd tier keeps the codes raw
        d = start_daemon(data)
        out, offsets = region(3), [0, STRIDE, 2 * STRIDE]
        with Client(address=d.address) as c:
            placed = c.load_pages_into(ns, keys, out, offsets, STRIDE)
            assert [i for i, _ in placed] == [0, 2]
            assert_slots(out, offsets, [blocks[0], None, blocks[2]])
            tiers = {t.name: t.verify_failures for t in c.stats().tiers}
            assert sum(tiers.values()) == 1  # counted, and the bad copy dropped
            assert c.lookup_keys(ns, keys)[1] is None
    finally:
        d.stop()


def test_a_version_1_blob_is_a_miss(tmp_path: Path, ns: str) -> None:
    """A blob of the old regrouped format (version 1) under a key asked for is refused on the
    daemon's read, never written into a slot."""
    data = tmp_path / "data"
    d = start_daemon(data)
    try:
        with Client(address=d.address) as c:
            keys, blobs, blocks = saved(c, ns, 2)
        assert d.stop() == 0
        # version 1's header in place (its checksum made right): the version field, bytes 4-5
        for path in sorted(p for p in data.rglob("*") if p.is_file()):
            raw = bytearray(path.read_bytes())
            at = raw.find(blobs[0][:64])
            if at >= 0:
                raw[at + 4 : at + 6] = (1).to_bytes(2, "little")
                old = bytearray(raw[at : at + len(blobs[0])])
                page.seal(old)
                raw[at : at + len(old)] = old
                path.write_bytes(bytes(raw))
                break
        else:
            raise AssertionError("the blob is in no file of the daemon's")
        d = start_daemon(data)
        out = region(2)
        with Client(address=d.address) as c:
            placed = c.load_pages_into(ns, keys, out, [0, STRIDE], STRIDE)
        assert [i for i, _ in placed] == [1]
        assert_slots(out, [0, STRIDE], [None, blocks[1]])
    finally:
        d.stop()


def _userns_works() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# the client, in a process of its own that no process without CAP_SYS_PTRACE over it may write into
_REFUSED_CLIENT = r"""
import ctypes, sys
from tests.client.test_page_loads import LAYOUT, STRIDE, assert_slots, page_manifest, region, saved
from kvstore.client import Client
assert ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE 0
with Client(address=sys.argv[1]) as c:
    keys, _, blocks = saved(c, sys.argv[2], 2)
    src = region(2)  # a save from the slots: encoded here, through the arena
    src[:len(blocks[0])] = list(blocks[0])
    m = page_manifest(sys.argv[2], keys[:1], "from-slots")
    assert c.save_pages(m, LAYOUT, src, [0], STRIDE, [0], [f"{sys.argv[2]}/0".encode()]).written == 0
    for _ in range(2):
        out = region(2)
        placed = c.load_pages_into(sys.argv[2], keys, out, [STRIDE, 0], STRIDE)
        assert [i for i, _ in placed] == [0, 1] and c.uses_shared_memory
        assert_slots(out, [STRIDE, 0], blocks)
    print(c._into_refused)
"""


@pytest.mark.skipif(not _userns_works(), reason="no unprivileged user namespaces here")
def test_where_the_kernel_refuses_the_write_the_client_loads_through_its_arena(tmp_path: Path, ns: str) -> None:
    """A daemon that may not write into the client (here: it runs in a user namespace of its own and
    the client is not dumpable; elsewhere another uid, Yama 2, a container without the client's pid
    namespace) is refused by the kernel (EPERM) before a byte moves: FAILED_PRECONDITION, remembered
    by the client, which loads this call and the next through its arena and copies the blocks in."""
    spawner = Exec(["unshare", "--user", "--map-root-user", *kvstore_command()])
    d = start_daemon(tmp_path / "data", spawner=spawner)
    try:
        r = subprocess.run([sys.executable, "-c", _REFUSED_CLIENT, d.address, ns], capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).resolve().parents[2])
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("cannot write into the caller's memory") and "not permitted" in r.stdout
        assert transport_stats(d).caller_memory_calls == 0
    finally:
        d.stop()


# -- saves: the daemon reads the blocks from their slots --------------------------------------------
def filled(blocks: list[bytes], offsets: list[int], slots: int) -> np.ndarray:
    out = region(slots)
    for b, off in zip(blocks, offsets):
        out[off : off + len(b)] = np.frombuffer(b, np.uint8)
    return out


def page_manifest(ns: str, keys: list[bytes], sid: str = "s") -> Manifest:
    return Manifest(sid, ns, LAYOUT.layout_id, 256 * len(keys), 0, tuple(keys), b"", (),
                    retention=Retention(ttl_s=3600), kind=Kind.ENGINE_PAGES)


@pytest.mark.parametrize("local", [True, False])
def test_the_daemon_reads_saved_blocks_from_their_slots(daemon: Daemon, ns: str, local: bool) -> None:
    """Over the local socket the daemon reads each block from its slot and builds the blob itself; over
    gRPC the client encodes it. Either way the stored blob is the one page.encode makes, byte for byte."""
    groups, hashes = [0, 1, 0], [f"{ns}/{i}".encode() for i in range(3)]
    blocks = [block(g, 40 + i) for i, g in enumerate(groups)]
    offsets = [STRIDE * s for s in (2, 0, 3)]
    keys = [page.page_key(LAYOUT.layout_id, ns, g, h) for g, h in zip(groups, hashes)]
    src = filled(blocks, offsets, 4)
    with Client(address=daemon.address, shared_memory=local) as c:
        c.register_layout(LAYOUT.definition())
        before = transport_stats(daemon).caller_memory_calls
        saved_ = c.save_pages(page_manifest(ns, keys), LAYOUT, src, offsets, STRIDE, groups, hashes)
        assert transport_stats(daemon).caller_memory_calls == before + local
        assert saved_.written == 3 and saved_.manifest.chunk_keys == tuple(keys)
    with Client(address=daemon.address) as c:
        got = dict(c.load_chunks(ns, keys))
        assert [bytes(got[i]) for i in range(3)] == [page.encode(LAYOUT, g, h, k, b)
                                                    for g, h, k, b in zip(groups, hashes, keys, blocks)]
        out = region(3)  # and back into other slots
        assert len(c.load_pages_into(ns, keys, out, [0, STRIDE, 2 * STRIDE], STRIDE)) == 3
        assert_slots(out, [0, STRIDE, 2 * STRIDE], blocks)


@pytest.mark.parametrize("local", [True, False])
def test_pages_of_several_regions_are_one_save_and_one_commit(daemon: Daemon, ns: str, local: bool) -> None:
    """An engine keeping each pool of pages in a buffer of its own (SGLang's HiCache host pools) saves them all
    in one call: over the local socket the daemon reads every region (``more_from_caller``), else the client
    encodes them; the new blobs are the regions' in order, byte for byte what page.encode makes."""
    a_groups, b_groups = [0, 0], [1]
    hashes = [f"{ns}/{i}".encode() for i in range(3)]
    blocks = [block(0, 50), block(0, 51), block(1, 52)]
    a = filled(blocks[:2], [STRIDE, 0], 2)  # another buffer each, slots in their own order
    b = filled(blocks[2:], [STRIDE], 2)
    keys = [page.page_key(LAYOUT.layout_id, ns, g, h) for g, h in zip([*a_groups, *b_groups], hashes)]
    with Client(address=daemon.address, shared_memory=local) as c:
        c.register_layout(LAYOUT.definition())
        before = transport_stats(daemon).caller_memory_calls
        saved_ = c.save_page_regions(page_manifest(ns, keys), LAYOUT, [
            PageSlots(a, [STRIDE, 0], STRIDE, a_groups, hashes[:2]), PageSlots(b, [STRIDE], STRIDE, b_groups,
                                                                                 hashes[2:])])
        assert transport_stats(daemon).caller_memory_calls == before + local  # one call
        assert saved_.written == 3 and saved_.manifest.chunk_keys == tuple(keys)
        got = dict(c.load_chunks(ns, keys))
        assert [bytes(got[i]) for i in range(3)] == [page.encode(LAYOUT, g, h, k, x) for g, h, k, x in
                                                    zip([*a_groups, *b_groups], hashes, keys, blocks)]


def test_a_bad_further_region_is_invalid_argument_naming_it_and_stores_nothing(daemon: Daemon, ns: str) -> None:
    h = [b"h0", b"h1"]
    keys = [page.page_key(LAYOUT.layout_id, ns, 0, x) for x in h]
    src = region(2)
    with Client(address=daemon.address) as c:
        c.register_layout(LAYOUT.definition())
        info = c.info()
    from kvstore.client import calls as rq
    good = pb.CallerPages(groups=[0], block_hashes=h[:1], region=pb.CallerMemory(
        address=src.ctypes.data, size=len(src), slot_offsets=[0], slot_bytes=STRIDE))
    past = pb.CallerPages(groups=[0], block_hashes=h[1:], region=pb.CallerMemory(
        address=src.ctypes.data, size=len(src), slot_offsets=[2 * STRIDE], slot_bytes=STRIDE))
    local = local_channel.LocalChannel(info.local_socket)
    try:
        header = rq.turn_header(page_manifest(ns, keys), 2)
        header.from_caller.CopyFrom(good)
        header.more_from_caller.append(past)
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVStoreStub(local).SaveChunks(iter([pb.SaveChunksRequest(header=header)]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more_from_caller[0]" in e.value.details()
        header = rq.turn_header(page_manifest(ns, keys[:1]), 1)
        header.more_from_caller.append(good)  # a further region without the first
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVStoreStub(local).SaveChunks(iter([pb.SaveChunksRequest(header=header)]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs from_caller" in e.value.details()
    finally:
        local.close()
    with Client(address=daemon.address) as c:
        assert c.list_sessions(ns) == [] and c.lookup_keys(ns, keys) == [None, None]


def test_bad_caller_pages_are_invalid_argument_and_store_nothing(daemon: Daemon, ns: str) -> None:
    h = [b"h0", b"h1"]
    keys = [page.page_key(LAYOUT.layout_id, ns, 0, x) for x in h]
    src = region(2)
    with Client(address=daemon.address) as c:
        c.register_layout(LAYOUT.definition())
        info = c.info()
        with pytest.raises(InvalidArgument, match=r"slot_offsets\[1\]"):  # the client's own check
            c.save_pages(page_manifest(ns, keys), LAYOUT, src, [0, STRIDE + 1], STRIDE, [0, 0], h)
        m = page_manifest(ns, keys)
    cases = {"a group the layout lacks": (pb.CallerPages(groups=[0, 7], block_hashes=h), "no such group"),
             "slots past the end": (pb.CallerPages(groups=[0, 0], block_hashes=h), "slot_offsets"),
             "one hash short": (pb.CallerPages(groups=[0, 0], block_hashes=h[:1]), "block hashes")}
    from kvstore.client import calls as rq
    local = local_channel.LocalChannel(info.local_socket)
    try:
        for name, (pages, want) in cases.items():
            offs = [0, 2 * STRIDE] if name == "slots past the end" else [0, STRIDE]
            pages.region.CopyFrom(pb.CallerMemory(address=src.ctypes.data, size=len(src), slot_offsets=offs,
                                                  slot_bytes=STRIDE))
            header = rq.turn_header(m, 2)
            header.from_caller.CopyFrom(pages)
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.KVStoreStub(local).SaveChunks(iter([pb.SaveChunksRequest(header=header)]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.value.details(), name
    finally:
        local.close()
    with grpc.insecure_channel(daemon.address) as ch:  # over gRPC no process is named: refused
        header = rq.turn_header(m, 2)
        header.from_caller.CopyFrom(pb.CallerPages(groups=[0, 0], block_hashes=h, region=pb.CallerMemory(
            address=src.ctypes.data, size=len(src), slot_offsets=[0, STRIDE], slot_bytes=STRIDE)))
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVStoreStub(ch).SaveChunks(iter([pb.SaveChunksRequest(header=header)]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "local socket" in e.value.details()
    with Client(address=daemon.address) as c:
        assert c.list_sessions(ns) == [] and c.lookup_keys(ns, keys) == [None, None]


def test_under_yama_1_the_client_names_the_daemon_its_ptracer_first(daemon: Daemon, ns: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no Yama: its ptrace_scope is faked as 1, and the PR_SET_PTRACER call recorded
    (made for real too: without Yama the kernel ignores it). The kernel's side of Yama is untested here."""
    from kvstore.client import load_into as into
    from kvstore.transport import cma

    scope = tmp_path / "ptrace_scope"
    scope.write_text("1\n")
    monkeypatch.setattr(into, "_YAMA", scope)
    named: list[int] = []
    real = cma.allow_writes_from
    monkeypatch.setattr(cma, "allow_writes_from", lambda pid: (named.append(pid), real(pid)))
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 2)
        assert named == []  # a save through the arena names no one
        out = region(2)
        assert len(c.load_pages_into(ns, keys, out, [0, STRIDE], STRIDE)) == 2
        assert named == [daemon.pid]  # the daemon, as the kernel names the local socket's peer
        c.save_pages(page_manifest(ns, keys), LAYOUT, out, [0, STRIDE], STRIDE, [0, 1],
                     [f"{ns}/{i}".encode() for i in range(2)])
        assert named == [daemon.pid]  # once per client


@pytest.mark.parametrize("local", [True, False])
def test_pages_into_several_regions_are_one_load(daemon: Daemon, ns: str, local: bool) -> None:
    """An engine keeping each pool of pages in a buffer of its own (SGLang's HiCache host pools) loads them
    all in one call: over the local socket the daemon writes every region's slots (``more_into``), else the
    client copies them in; bit-exact, each hit a view of its own region, misses' slots untouched."""
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 5)
    a, b, empty, d = region(3), region(4), region(1), region(2)
    a_offs, b_offs, d_offs = [2 * STRIDE, 0], [STRIDE, 3 * STRIDE, 0], [STRIDE]
    runs = [PageLoad(a, [keys[0], keys[1]], a_offs, STRIDE),
            PageLoad(b, [keys[2], bytes(16), keys[3]], b_offs, STRIDE),
            PageLoad(empty, [], [], STRIDE),
            PageLoad(d, [keys[4]], d_offs, STRIDE)]
    with Client(address=daemon.address, shared_memory=local) as c:
        before = transport_stats(daemon).caller_memory_calls
        placed = c.load_page_regions(ns, runs)
        assert transport_stats(daemon).caller_memory_calls == before + local  # one call, written by the daemon
    assert [[i for i, _ in p] for p in placed] == [[0, 1], [0, 2], [], [0]]
    assert [[bytes(v) for _, v in p] for p in placed] == [blocks[:2], [blocks[2], blocks[3]], [], [blocks[4]]]
    for p, out in zip(placed, (a, b, empty, d)):
        assert all(np.shares_memory(np.frombuffer(v, np.uint8), out) for _, v in p)
    assert_slots(a, a_offs, blocks[:2])
    assert_slots(b, b_offs, [blocks[2], None, blocks[3]])
    assert (empty == FILL).all()
    assert_slots(d, d_offs, [blocks[4]])


def test_the_async_face_loads_several_regions_the_same_way(daemon: Daemon, ns: str) -> None:
    import asyncio

    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 2)
    a, b = region(1), region(2)

    async def go() -> list[list[tuple[int, memoryview]]]:
        async with AsyncClient(address=daemon.address) as ac:
            return await ac.load_page_regions(ns, [PageLoad(a, keys[:1], [0], STRIDE),
                                                   PageLoad(b, keys[1:], [STRIDE], STRIDE)])

    assert [[i for i, _ in p] for p in asyncio.run(go())] == [[0], [0]]
    assert_slots(a, [0], blocks[:1])
    assert_slots(b, [STRIDE], blocks[1:])


def _raw_load(info: pb.ServerInfo, request: pb.LoadChunksRequest) -> grpc.RpcError:
    """``request`` sent as it is to the daemon's local socket: the error it is answered."""
    local = local_channel.LocalChannel(info.local_socket)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.KVStoreStub(local).LoadChunks(request))
        return e.value
    finally:
        local.close()


@pytest.mark.parametrize("case", ["past the end", "overlapping", "across regions", "counts", "no slot bytes",
                                  "no address", "without into"])
def test_bad_further_regions_are_invalid_argument_naming_them_before_any_write(daemon: Daemon, ns: str,
                                                                              case: str) -> None:
    """The daemon checks every region a load names before it reads or writes anything (the client checks
    them too, the same way: here the raw request goes to the daemon's local socket)."""
    with Client(address=daemon.address) as c:
        keys, _, _ = saved(c, ns, 3)
        info = c.info()
    a, b = region(2), region(2)

    def mem(out: np.ndarray, offs: list[int], slot_bytes: int = STRIDE, size: int | None = None) -> pb.CallerMemory:
        return pb.CallerMemory(address=out.ctypes.data, size=len(out) if size is None else size, slot_offsets=offs,
                               slot_bytes=slot_bytes)

    first, field = mem(a, [0, STRIDE]), "more_into[0]"
    more = {"past the end": [mem(b, [STRIDE + 1])], "overlapping": [mem(b, [0]), mem(b, [])],
            "across regions": [mem(a, [STRIDE // 2])], "counts": [mem(b, [0, STRIDE])],
            "no slot bytes": [mem(b, [0], 0)], "no address": [pb.CallerMemory(size=10, slot_offsets=[0],
                                                                                slot_bytes=STRIDE)],
            "without into": [mem(b, [0])]}[case]
    if case == "overlapping":  # the further region's own slots overlap
        more = [mem(b, [0, STRIDE - 1])]
        first = mem(a, [0])
        field = "more_into[0]: CallerMemory.slot_offsets[1]"
    elif case == "across regions":  # inside its region, but over a slot of into's (the same buffer)
        first, field = mem(a, [0, STRIDE]), "overlaps a slot of into"
    elif case == "counts":
        field = "more_into"
    elif case == "no slot bytes":
        field = "more_into[0].slot_bytes"
    request = pb.LoadChunksRequest(namespace=ns, keys=keys, into=first, more_into=more)
    if case == "without into":
        request.ClearField("into")
        field = "more_into needs into"
    err = _raw_load(info, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
    assert (a == FILL).all() and (b == FILL).all()


@pytest.mark.parametrize("local", [True, False])
def test_bad_regions_are_invalid_argument_in_the_client_before_any_write(daemon: Daemon, ns: str,
                                                                         local: bool) -> None:
    with Client(address=daemon.address) as c:
        keys, _, blocks = saved(c, ns, 3)
    a, b = region(2), region(2)
    small = len(blocks[1])  # group 1's block fits, group 0's does not
    cases = {  # runs -> what the error names
        "regions[1]: CallerMemory.slot_offsets[0]": [PageLoad(a, keys[:2], [0, STRIDE], STRIDE),
                                                     PageLoad(b, keys[2:], [STRIDE + 1], STRIDE)],
        r"regions[1]: CallerMemory.slot_offsets names 2 slots for 1 keys": [
            PageLoad(a, keys[:2], [0, STRIDE], STRIDE), PageLoad(b, keys[2:], [0, STRIDE], STRIDE)],
        "overlaps a slot of regions[0]": [PageLoad(a, keys[:1], [0], STRIDE),
                                          PageLoad(a[STRIDE // 2 :], keys[1:2], [0], STRIDE)],
        "slot_bytes": [PageLoad(a, keys[:1], [0], STRIDE), PageLoad(b, [keys[1], keys[0]], [0, small], small)],
    }
    with Client(address=daemon.address, shared_memory=local) as c:
        for names, runs in cases.items():
            with pytest.raises(InvalidArgument) as e:
                c.load_page_regions(ns, runs)
            assert names in str(e.value)
    assert (a == FILL).all() and (b == FILL).all()  # not even the blocks that fit
