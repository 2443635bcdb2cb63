"""A full disk, and the LMDB map limit: a save fails with ResourceExhausted and a clear message,
nothing of it is left behind, everything stored before stays readable, and saves work again once
space returns (issue 8, defect 6). The disk-full tests mount a real 8 MiB tmpfs; where mounting
is not permitted they skip, saying so. Before the fix, LMDB's writemap made this a SIGBUS."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.errors import ResourceExhausted
from kvstore.format.layout import get_layout
from kvstore.store import SessionStore, StoreConfig, open_store
from kvstore.tiers import SsdTierConfig
from tests.helpers.daemon import make_session, running_daemon, save_session
from tests.helpers.store import Session, build_session, check_chunk, load, save, store_config, token_stream

TINY16 = get_layout("tiny-16")
CT = 256  # ~57 KB chunks: a few dozen fill the filesystem
FS_BYTES = 8 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for this test (needs CAP_SYS_ADMIN, e.g. root in a container)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        pytest.skip(f"cannot mount a small tmpfs here (needs CAP_SYS_ADMIN): {e} {detail.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def session(sid: str, chunks: int, seed: int) -> Session:
    return build_session("ns", sid, token_stream(seed, chunks * CT + 5), layout=TINY16, chunk_tokens=CT)


def assert_loads(ss: SessionStore, s: Session) -> None:
    m = ss.get(s.namespace, s.session_id)
    for i, (k, blob) in enumerate(load(ss, s.namespace, m.chunk_keys)):
        check_chunk(blob, s.layout, k, s.chunk_ids(i))


def config(root: Path, **ssd: int) -> StoreConfig:
    base = store_config(root, chunk_tokens=CT)
    ssd_config = SsdTierConfig(path=str(root / "ssd"), map_size=ssd.pop("map_size", 1 << 20), **ssd)
    return StoreConfig(tiers=(base.tiers[0], ssd_config), chunk_tokens=CT)


@contextlib.contextmanager
def ballast(fs: Path, leave: int) -> Iterator[None]:
    """Fill ``fs`` but for ``leave`` bytes; space returns when the block ends."""
    st = os.statvfs(fs)
    path = fs / "ballast"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, max(1, st.f_bavail * st.f_frsize - leave))
    finally:
        os.close(fd)
    try:
        yield
    finally:
        path.unlink()


def test_a_save_on_a_full_disk_fails_cleanly_and_works_again_once_space_returns(small_fs: Path) -> None:
    ss = open_store(config(small_fs))
    try:
        before = session("before", 4, seed=1)
        save(ss, before)
        big = session("big", 12, seed=2)  # ~700 KB
        with ballast(small_fs, leave=200 << 10):
            with pytest.raises(ResourceExhausted, match=f"no space left .*{small_fs}.*about \\d+ bytes"):
                save(ss, big)
            assert set(ss.store.tiers[0].keys()) <= set(before.keys)  # nothing of the failed save stays
            assert ss.lookup("ns", TINY16.layout_id, big.token_ids).cached_tokens == 0
            assert_loads(ss, before)  # reads keep working on the full disk
            ss.store.tiers[0].delete_many([before.keys[0]])  # and come from the ssd tier
            assert_loads(ss, before)
        save(ss, big)  # space returned
        assert_loads(ss, big)
    finally:
        ss.store.close()
    ss = open_store(config(small_fs))  # and both survive a restart
    try:
        assert sorted(m.session_id for m in ss.list_sessions()) == ["before", "big"]
        assert_loads(ss, before)
        assert_loads(ss, big)
    finally:
        ss.store.close()


def test_a_commit_on_a_full_disk_fails_cleanly(small_fs: Path) -> None:
    ss = open_store(config(small_fs))
    try:
        s = session("s", 2, seed=3)
        ss.save_chunks("ns", TINY16.layout_id, s.parent(0), 0, s.blobs)
        with ballast(small_fs, leave=0):
            with pytest.raises(ResourceExhausted, match="no space left"):
                ss.commit(s.manifest(metadata={"pad": "x" * (64 << 10)}))
            assert ss.list_sessions() == []
        ss.commit(s.manifest())
        assert_loads(ss, s)
    finally:
        ss.store.close()


def test_the_map_limit_fails_a_save_cleanly_and_deleting_makes_room(tmp_path: Path) -> None:
    cfg = config(tmp_path, map_size=1 << 20, max_map_bytes=2 << 20)
    ss = open_store(cfg)
    try:
        saved = []
        with pytest.raises(ResourceExhausted, match="map limit of 2097152 bytes"):
            for i in range(40):
                s = session(f"s{i}", 4, seed=10 + i)
                save(ss, s)
                saved.append(s)
        assert 0 < len(saved) < 40
        failed = session(f"s{len(saved)}", 4, seed=10 + len(saved))
        assert ss.lookup("ns", TINY16.layout_id, failed.token_ids).cached_tokens == 0
        for s in saved:
            assert_loads(ss, s)
        ss.delete("ns", saved[0].session_id)
        ss.delete("ns", saved[1].session_id)
        save(ss, failed)
        assert_loads(ss, failed)
    finally:
        ss.store.close()


def test_the_daemon_answers_resource_exhausted_serves_reads_and_recovers(small_fs: Path) -> None:
    """Through gRPC: RESOURCE_EXHAUSTED with the message, no SIGBUS; reads go on; space returns."""
    before = make_session(tokens=4 * CT + 5, chunk_tokens=CT, session_id="before", seed=1)
    big = make_session(tokens=12 * CT + 5, chunk_tokens=CT, session_id="big", seed=2)
    with running_daemon(small_fs) as daemon:  # its log goes beside the mount, not onto the full disk
        client = Client(address=daemon.address)
        try:
            save_session(client, before)
            with ballast(small_fs, leave=200 << 10):
                with pytest.raises(ResourceExhausted, match="no space left"):
                    save_session(client, big)
                m, chunks = client.load_session("ns", "before")
                assert m.chunk_keys == tuple(before.keys)
                assert [bytes(b) for _, b in chunks] == before.blobs
                assert client.lookup("ns", big.layout.layout_id, big.token_ids).cached_tokens == 0
            save_session(client, big)
            m, chunks = client.load_session("ns", "big")
            assert [bytes(b) for _, b in chunks] == big.blobs
        finally:
            client.close()
        assert daemon.proc.poll() is None  # still serving
