"""One LMCache client process for ``bench_peers.py``; runs in the peers venv (LMCache's own install).

It drives ``lmcache_server`` (LMCache's CPU-mode remote server) through LMCache's own client class,
``LMCServerConnector`` (what an ``lm://host:port`` remote_url creates inside LMCache's storage
manager), with LMCache's own ``LocalCPUBackend`` allocating the memory objects, exactly as the
engine does. What LMCache's protocol promises: a PUT is a header and the bytes written to the
socket, with no answer from the server, and the server keeps the bytes in a Python dict in its
memory (no eviction, no disk). So a save here is timed until the server has taken every chunk:
all PUTs, then one EXIST round trip on the same connection (the server handles a connection's
commands in order, so its answer means every PUT before it is in the dict). A load is one GET per
chunk, each received into a memory object of LMCache's allocator (``recv_into``), then freed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_proto
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from peers_lmc_engine import EngineClient


class LmcClient:
    """One connection to lmcache_server and the session's chunks as LMCache memory objects."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        data = Path(cmd["blob_file"]).read_bytes()
        size, n = cmd["chunk_bytes"], cmd["n_chunks"]
        self.blobs = [data[i * size:(i + 1) * size] for i in range(n)]
        self.size = size
        gb = (3 * n * size + (64 << 20)) / 2**30  # the session, a loaded copy, headroom
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=cmd["chunk_tokens"], local_cpu=False,
                                                max_local_cpu_size=gb, remote_url=f"lm://127.0.0.1:{cmd['port']}")
        md = LMCacheMetadata(model_name=f"bench{cmd['idx']}", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 1, cmd["chunk_tokens"], 1, 1))
        self.backend = LocalCPUBackend(cfg, md)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.conn = LMCServerConnector("127.0.0.1", cmd["port"], self.loop, self.backend)
        self.keys = [CacheEngineKey(f"bench{cmd['idx']}-{cmd['chunk_tokens']}", 1, 0, i, torch.uint8)
                     for i in range(n)]
        self.objs = [self._obj(b) for b in self.blobs]

    def _obj(self, blob: bytes) -> MemoryObj:
        """A memory object of LMCache's allocator holding ``blob`` (the engine's GPU->CPU copy, untimed)."""
        obj = self.backend.allocate(torch.Size([1, 1, 1, len(blob)]), torch.uint8, MemoryFormat.KV_2LTD)
        if obj is None:
            raise RuntimeError("LMCache's allocator is full")
        memoryview(obj.byte_array).cast("B")[:] = blob
        return obj

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def save(self) -> None:
        async def put_all() -> bool:
            for k, o in zip(self.keys, self.objs):
                await self.conn.put(k, o)
            return await self.conn.exists(self.keys[-1])

        if not self.run(put_all()):
            raise RuntimeError("lmcache_server does not hold the last chunk after the save")

    def load(self, check: bool = False) -> None:
        async def get_all() -> list[MemoryObj | None]:
            return [await self.conn.get(k) for k in self.keys]

        got = self.run(get_all())
        try:
            for i, o in enumerate(got):
                if o is None or len(o.byte_array) != self.size:
                    raise RuntimeError(f"chunk {i}: lmcache_server answered {None if o is None else len(o.byte_array)}")
                if check and bytes(memoryview(o.byte_array).cast("B")) != self.blobs[i]:
                    raise RuntimeError(f"chunk {i}: loaded bytes differ from the saved ones")
        finally:
            for o in got:
                if o is not None:
                    o.ref_count_down()

    def close(self) -> None:
        self.run(self.conn.close())
        for o in self.objs:
            o.ref_count_down()


def main() -> None:
    state: dict[str, Any] = {}

    def setup(cmd: dict[str, Any]) -> dict[str, Any]:
        for k in ("c", "e"):
            if k in state:
                state.pop(k).close()
        state["c"] = LmcClient(cmd)
        state["e"] = EngineClient(cmd)
        import lmcache

        return {"lmcache": getattr(lmcache, "__version__", "?"), "engine_chunk_bytes": state["e"].chunk_bytes}

    def prepare(cmd: dict[str, Any]) -> str:
        state["c"].save()
        state["c"].load(check=True)
        state["e"].save()
        state["e"].load()
        return "ok"

    peers_proto.serve(setup, lambda: {"save lmcache-server": (state["c"].save, None),
                                      "load lmcache-server": (state["c"].load, None),
                                      "save lmcache-engine": (state["e"].save, None),
                                      "load lmcache-engine": (state["e"].load, None)}, prepare)
    os._exit(0)  # LMCache's engine leaves non-daemon threads behind; nothing is left to flush


if __name__ == "__main__":
    main()
