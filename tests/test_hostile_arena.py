"""A hostile client of the daemon's own user, in a process of its own (tests/hostile_arena.py), does
what it can to its arena: truncates the file under the daemon, punches its pages out, attaches sparse
files, unsealed or hugetlbfs memfds, fds that are no memfd, NUL bytes in paths. Before the fix a
truncated arena killed the daemon with SIGBUS at the next load or save through it, for every tenant.
Now each step gets a gRPC status, the daemon lives, and another tenant is served byte for byte.

The last test starts a daemon in a mount namespace of its own whose /dev/shm is 8 MiB (as a Docker
container's 64 MiB is, in kind): a sparse 64 MiB arena file there made the daemon's prefault SIGBUS;
it is refused now, and a client's 64 MiB arena (a memfd, not in /dev/shm) works there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import REPO, Daemon, clean_env, make_session, running_daemon, save_session

from kvstore import shm
from kvstore.client import Client

TOKENS = '[tokens]\n"tok-evil" = ["evil"]\n"tok-good" = ["good"]\n"tok-admin" = ["*"]\n'
HOSTILE = REPO / "tests" / "hostile_arena.py"
EVIL = make_session(namespace="evil", session_id="e1", tokens=700, seed=3)
GOOD = make_session(namespace="good", session_id="g1", tokens=700, seed=4)
CALLS = [f"{m} {t}" for t in ("grpc", "local") for m in ("LoadChunks", "LoadSession", "SaveChunks")]
TRUNCATED = ("FAILED_PRECONDITION", "the arena file cannot be used: it was truncated")

# what each step of each case must answer: (code, a part of the message); None: any status but a
# daemon's failure (INTERNAL, UNKNOWN, UNAVAILABLE: a dead daemon)
EXPECTED: dict[str, dict[str, tuple[str, str] | None]] = {
    "file_truncated": {"attach": ("OK", ""), **{c: TRUNCATED for c in CALLS}},
    "file_holes": {"attach": ("OK", ""), **{c: ("OK", "") for c in CALLS}},
    "file_sparse": {"attach": ("INVALID_ARGUMENT", "is sparse"), **{c: ("INVALID_ARGUMENT", "unknown arena")
                                                                    for c in CALLS}},
    "sealed_truncated": {"attach": ("OK", ""), "ftruncate": ("OSError", "Operation not permitted"),
                         **{c: ("OK", "") for c in CALLS}},
    "sealed_holes": {"attach": ("OK", ""), **{c: None for c in CALLS}},
    "memfd_unsealed": {"attach": ("INVALID_ARGUMENT", "not sealed against shrinking"),
                       **{c: ("INVALID_ARGUMENT", "unknown arena") for c in CALLS}},
    "memfd_sparse": {"attach": ("INVALID_ARGUMENT", "is sparse")},
    "memfd_hugetlb": {"attach": ("INVALID_ARGUMENT", "hugetlbfs")},
    "not_memfds": {"pipe": ("INVALID_ARGUMENT", "not a regular file"),
                   "shm file": ("INVALID_ARGUMENT", "not sealed against shrinking"),
                   "disk file": ("INVALID_ARGUMENT", "not a memfd on tmpfs"),
                   "directory": ("INVALID_ARGUMENT", "not a regular file"),
                   "two fds": ("INVALID_ARGUMENT", "one memfd, not 2 fds"),
                   "memfd and a path": ("INVALID_ARGUMENT", "one or the other"),
                   "wrong size": ("INVALID_ARGUMENT", "is 1048576 bytes, not 2097152"),
                   "wrong nonce": ("INVALID_ARGUMENT", "does not hold the nonce")},
    "fds_with_other_calls": {f"GetServerInfo {i}": ("OK", "") for i in range(64)},
    "nul_paths": {f"{w} {t}": ("INVALID_ARGUMENT", "contains a NUL byte")
                  for w in ("dir", "name", "long") for t in ("grpc", "local")},
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    if shm.default_shm_dir() is None:
        pytest.skip("no writable /dev/shm on this host")
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "tokens.toml").write_text(TOKENS)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        for token, s in (("tok-evil", EVIL), ("tok-good", GOOD)):
            with Client(address=d.address, token=token, shared_memory=False) as c:
                save_session(c, s)
        yield d
        assert "internal error" not in d.log() and "Traceback" not in d.log(), d.log()[-3000:]


def spec_file(d: Daemon, directory: Path, **extra: object) -> Path:
    spec = {"address": d.address, "token": "tok-evil", "namespace": EVIL.namespace, "session_id": EVIL.session_id,
            "keys": [k.hex() for k in EVIL.keys], "layout_id": EVIL.layout.layout_id.hex(),
            "blob": EVIL.blobs[0].hex(), "scratch": str(directory), **extra}
    path = directory / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def run_hostile(spec: Path, case: str, prefix: list[str] | None = None) -> dict[str, list[str]]:
    """The hostile client's process; its answers, step by step."""
    done = subprocess.run([*(prefix or []), sys.executable, str(HOSTILE), str(spec), case], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def fd_count(d: Daemon) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def check(case: str, got: dict[str, list[str]]) -> None:
    if got.get("attach", [""])[0] == "SKIPPED":
        pytest.skip(got["attach"][1])
    assert set(got) == set(EXPECTED[case]), got
    for step, want in EXPECTED[case].items():
        code, details = got[step]
        if want is None:
            assert code not in ("INTERNAL", "UNKNOWN", "UNAVAILABLE", "DEADLINE_EXCEEDED", "OSError"), (step, got[step])
        else:
            assert code == want[0] and want[1] in details, (step, got[step])


def the_other_tenant_is_served(d: Daemon) -> None:
    """A same-host client of another tenant (arena and local socket) loads its session bit-exact."""
    with Client(address=d.address, token="tok-good", arena_bytes=4 << 20) as c:
        _, chunks = c.load_session(GOOD.namespace, GOOD.session_id)
        assert {i: bytes(b) for i, b in chunks} == dict(enumerate(GOOD.blobs))
        assert c.uses_shared_memory


@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_hostile_arena_gets_a_status_and_the_daemon_serves_on(daemon: Daemon, tmp_path: Path, case: str) -> None:
    fds = fd_count(daemon)
    got = run_hostile(spec_file(daemon, tmp_path), case)
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
    driver = REPO / "tests" / "small_shm_driver.py"
    done = subprocess.run([*prefix, sys.executable, str(driver), str(tmp_path)], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["shm_bytes"] == 8 << 20
    assert report["daemon_alive"], report
    check("file_sparse", report["hostile"])
    assert report["good_client"] == {"shared_memory": True, "arena_bytes": 64 << 20, "loaded_exact": True}
