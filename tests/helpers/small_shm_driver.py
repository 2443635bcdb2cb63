"""Run inside a mount namespace whose /dev/shm is small (tests/reliability/test_hostile_arena.py starts it so):
``python tests/helpers/small_shm_driver.py TMPDIR``. Starts a daemon there, lets the hostile client
(benchmarks/reliability/hostile_client.py) attach a sparse arena file larger than that /dev/shm, then checks that the
daemon still serves a good client whose 64 MiB arena (a memfd: not in /dev/shm) is larger than
/dev/shm too. Prints one JSON report."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: tests.helpers

from kvstore.client import Client
from tests.helpers.daemon import make_session, running_daemon, save_session
from tests.reliability.test_hostile_arena import EVIL, hostile, spec_file


def main(tmp: Path) -> int:
    st = os.statvfs("/dev/shm")
    (tmp / "tokens.toml").write_text(hostile.TOKENS)
    good = make_session(namespace="good", session_id="g1", tokens=700, seed=4)
    with running_daemon(tmp / "data", "--tokens-file", str(tmp / "tokens.toml")) as d:
        with Client(address=d.address, token="tok-evil", shared_memory=False) as c:
            save_session(c, EVIL)
        answers = hostile.run_case(spec_file(d, tmp, sparse_bytes=64 << 20), "file_sparse")
        alive = d.proc.poll() is None
        with Client(address=d.address, token="tok-good", arena_bytes=64 << 20) as c:
            save_session(c, good)
            _, chunks = c.load_session(good.namespace, good.session_id)
            good_client = {"shared_memory": c.uses_shared_memory, "arena_bytes": c.carrier.arena.size
                           if c.uses_shared_memory else 0,  # type: ignore[attr-defined]
                           "loaded_exact": {i: bytes(b) for i, b in chunks} == dict(enumerate(good.blobs))}
    print(json.dumps({"shm_bytes": st.f_blocks * st.f_frsize, "daemon_alive": alive, "hostile": answers,
                      "good_client": good_client}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
