"""One kvstore / redis-py / LMDB client process for ``bench_peers.py`` (runs in kvstore's .venv).

``setup`` makes this client's session (real chunks at the deepseek-v4.1-flash layout through the
real FP4 codecs, ``common.chunk_session``, seeded by the client's index), writes its blobs to a file
for the LMCache client of the same index (so both save the same bytes), and connects: a kvstore
``Client`` on the gRPC stream (``shared_memory=False``) and one on the same-host path (arena + Unix
socket), redis-py, and an LMDB environment of its own (``sync=True``: each commit fsyncs).
Saves are durable turn saves (new chunks + manifest, one fsync'd commit), each followed by an
untimed delete so the next one writes every chunk again.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common
from benchmarks.daemon import ceilings
from benchmarks.daemon.bench_daemon import manifest_for
from benchmarks.peers import peers_proto
from kvstore.client import Client
from kvstore.format.layout import get_layout

LAYOUT = "deepseek-v4.1-flash"
ARENA_BYTES = 64 << 20
SID = "s"


class KvClient:
    """The session of one client and a connection to every peer this venv drives."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        import lmdb
        import redis

        self.ns, ct = f"bench{cmd['idx']}", cmd["chunk_tokens"]
        self.blobs, self.keys, ids = common.chunk_session(get_layout(LAYOUT), self.ns, cmd["n_chunks"], ct,
                                                          seed=cmd["idx"])
        Path(cmd["blob_file"]).write_bytes(b"".join(self.blobs))
        self.nbytes = sum(map(len, self.blobs))
        self.manifest = manifest_for(self.ns, SID, self.keys, ids, ct)
        self.grpc = Client(address=cmd["address"], shared_memory=False)
        self.local = Client(address=cmd["address"], arena_bytes=ARENA_BYTES)
        # the same two paths to a daemon started with --no-sync: what kvstore's save costs without its fsync
        self.grpc_ns = Client(address=cmd["address_nosync"], shared_memory=False)
        self.local_ns = Client(address=cmd["address_nosync"], arena_bytes=ARENA_BYTES)
        for c in (self.grpc, self.local, self.grpc_ns, self.local_ns):
            c.info()
        if not self.local.uses_shared_memory or self.grpc.uses_shared_memory:
            raise RuntimeError("the daemon did not offer the same-host path (or forced it on the stream client)")
        self.redis = redis.Redis(host="127.0.0.1", port=cmd["redis_port"])
        self.lmdb = lmdb.open(cmd["lmdb_dir"], map_size=1 << 31)
        self.red = ceilings.redis_ops(self.redis, self.keys, self.blobs, self.expect)
        self.put, self.get, self.drop = ceilings.lmdb_ops(self.lmdb, self.keys, self.blobs, self.expect)

    def expect(self, got: int) -> None:
        if got != self.nbytes:
            raise RuntimeError(f"read {got} bytes, expected {self.nbytes}")

    def save(self, c: Client) -> None:
        # base=0: replace whatever is stored (clients save and delete one session in turn; no race is measured)
        if c.save_session(self.manifest, self.blobs, base=0).written != len(self.blobs):
            raise RuntimeError("chunks were already stored: the save would not be measured")

    def load(self, c: Client, check: bool = False) -> None:
        _, it = c.load_session(self.ns, SID, zero_copy=c.uses_shared_memory)
        blobs = [b for _, b in it]
        self.expect(sum(map(len, blobs)))
        if check and [bytes(b) for b in blobs] != self.blobs:
            raise RuntimeError("loaded bytes differ from the saved ones")

    def ops(self) -> dict[str, tuple[peers_proto.Op, peers_proto.Op | None]]:
        unsave = lambda: self.grpc.delete_session(self.ns, SID)  # noqa: E731
        unsave_ns = lambda: self.grpc_ns.delete_session(self.ns, SID)  # noqa: E731
        return {"save kvstore-grpc": (lambda: self.save(self.grpc), unsave),
                "save kvstore-local": (lambda: self.save(self.local), unsave),
                "save kvstore-grpc-nosync": (lambda: self.save(self.grpc_ns), unsave_ns),
                "save kvstore-local-nosync": (lambda: self.save(self.local_ns), unsave_ns),
                "save redis": (self.red["save redis SET xN"], None),
                "save lmdb": (self.put, self.drop),
                "load kvstore-grpc": (lambda: self.load(self.grpc), None),
                "load kvstore-local": (lambda: self.load(self.local), None),
                "load redis": (self.red["load redis GET xN"], None),
                "load lmdb": (self.get, None)}

    def prepare(self) -> str:
        """Store what the loads read: the kvstore session (hot in the daemon's host tier), the redis
        keys and the LMDB records; check that each path reads back exactly the saved bytes."""
        self.save(self.grpc)
        self.red["save redis SET xN"]()
        self.put()
        for c in (self.grpc, self.local):
            self.load(c, check=True)
        return "ok"

    def close(self) -> None:
        for c in (self.grpc, self.local, self.grpc_ns, self.local_ns):
            c.close()
        self.redis.close()
        self.lmdb.close()


def main() -> None:
    state: dict[str, KvClient] = {}

    def setup(cmd: dict[str, Any]) -> int:
        if "c" in state:
            old = state.pop("c")
            with contextlib.suppress(Exception):  # nothing stored yet is fine
                old.grpc.delete_session(old.ns, SID)
            old.drop()
            old.close()
        state["c"] = KvClient(cmd)
        return len(state["c"].blobs[0])

    peers_proto.serve(setup, lambda: state["c"].ops(), lambda cmd: state["c"].prepare())


if __name__ == "__main__":
    main()
