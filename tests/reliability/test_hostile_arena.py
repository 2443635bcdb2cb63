"""A hostile client of the daemon's own user, in a process of its own
(benchmarks/reliability/hostile_client.py; the long mode is ``benchmarks/reliability/bench_hostile.py``), does
what it can to its arena: truncates the file under the daemon (once, and over and over while its own
loads and saves run through it), punches its pages out, attaches sparse
files, unsealed or hugetlbfs memfds, fds that are no memfd, NUL bytes in paths. Before the fix a
truncated arena killed the daemon with SIGBUS at the next load or save through it, for every tenant.
Now each step gets a gRPC status, the daemon lives, and another tenant is served byte for byte.

The last test starts a daemon in a mount namespace of its own whose /dev/shm is 8 MiB (as a Docker
container's 64 MiB is, in kind): a sparse 64 MiB arena file there made the daemon's prefault SIGBUS;
it is refused now, and a client's 64 MiB arena (a memfd, not in /dev/shm) works there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.transport import shm
from tests.helpers.daemon import REPO, Daemon, clean_env, make_session, running_daemon, save_session

sys.path.insert(0, str(REPO))
from benchmarks.reliability import hostile

HOSTILE_TOKEN = "tok-evil"
EVIL = make_session(namespace="evil", session_id="e1", tokens=700, seed=3)
GOOD = make_session(namespace="good", session_id="g1", tokens=700, seed=4)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if shm.default_shm_dir() is None:
        pytest.skip("no writable /dev/shm on this host")
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "tokens.toml").write_text(hostile.TOKENS)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        for token, s in ((HOSTILE_TOKEN, EVIL), ("tok-good", GOOD)):
            with Client(address=d.address, token=token, shared_memory=False) as c:
                save_session(c, s)
        yield d
        assert "internal error" not in d.log() and "Traceback" not in d.log(), d.log()[-3000:]


def spec_file(d: Daemon, directory: Path, **extra: object) -> Path:
    return hostile.write_spec(directory / "spec.json", d.address, EVIL, directory, seconds=0.5, **extra)


def fd_count(d: Daemon) -> int:
    """The daemon's open fds but its pidfds: each local-socket connection keeps the pidfd of its last
    sender until its next read (kvstore/transport/sender.py), one per connection however many calls,
    so how many are open depends on which connections are, not on fds a client passed."""
    fds = 0
    for name in os.listdir(f"/proc/{d.proc.pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed while listed
            fds += os.readlink(f"/proc/{d.proc.pid}/fd/{name}") not in ("anon_inode:[pidfd]", "pidfd")
    return fds


def check(case: str, answers: dict[str, list[str]]) -> None:
    if answers.get("attach", [""])[0] == hostile.SKIPPED:
        pytest.skip(answers["attach"][1])
    problems = hostile.check(case, answers)
    assert not problems, problems


def the_other_tenant_is_served(d: Daemon) -> None:
    """A same-host client of another tenant (arena and local socket) loads its session bit-exact."""
    with Client(address=d.address, token="tok-good", arena_bytes=4 << 20) as c:
        _, chunks = c.load_session(GOOD.namespace, GOOD.session_id)
        assert {i: bytes(b) for i, b in chunks} == dict(enumerate(GOOD.blobs))
        assert c.uses_shared_memory


@pytest.mark.parametrize("case", list(hostile.EXPECTED))
def test_a_hostile_arena_gets_a_status_and_the_daemon_serves_on(daemon: Daemon, tmp_path: Path, case: str) -> None:
    fds = fd_count(daemon)
    got = hostile.run_case(spec_file(daemon, tmp_path), case)
    assert daemon.proc.poll() is None, f"the daemon died: exit {daemon.proc.returncode}; answers {got}"
    check(case, got)
    the_other_tenant_is_served(daemon)
    if case in ("fds_with_other_calls", "not_memfds", "memfd_unsealed", "memfd_sparse", "memfd_hugetlb"):
        assert fd_count(daemon) <= fds + 2, "fds passed to the daemon were kept"  # (the other tenant's arena: 1)


def _private_small_shm() -> list[str]:
    """A command prefix that runs in a mount namespace of its own with an 8 MiB /dev/shm, if allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run([unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=8m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()}")
    return [unshare, "-m", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh"]


def test_on_a_small_dev_shm_a_sparse_arena_is_refused_and_memfd_arenas_work(tmp_path: Path) -> None:
    """Daemon, hostile client and a good client in one namespace whose /dev/shm is 8 MiB."""
    prefix = _private_small_shm()
    driver = REPO / "tests" / "helpers" / "small_shm_driver.py"
    done = subprocess.run([*prefix, sys.executable, str(driver), str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["shm_bytes"] == 8 << 20
    assert report["daemon_alive"], report
    check("file_sparse", report["hostile"])
    assert report["good_client"] == {"shared_memory": True, "arena_bytes": 64 << 20, "loaded_exact": True}
