"""LMCache's standalone engine with an ``lm://`` remote: how LMCache itself stores and retrieves.

Runs in the peers venv, inside ``peers_lmc_worker.py``. ``LMCacheStandaloneStarter`` (LMCache's
own ``python -m lmcache.v1.standalone``, no vLLM, no GPU) builds a real ``LMCacheEngine`` whose
storage manager has a ``RemoteBackend`` over ``lm://127.0.0.1:PORT`` and, with ``local_cpu``
off, keeps nothing in its own memory, so every retrieve reads from ``lmcache_server``. Its GPU
connector is LMCache's ``MockGPUConnector``, whose copies are no-ops: the engine moves chunks of the
same size as kvstore's (float16 KV of shape [1 layer, 2, chunk tokens, 1 head, 224], 4 x 224 B a
token: 229,376 B for 256 tokens, 1,050,112 B for 1,172; kvstore's are 229,208 and 1,048,136) but
not the same bytes (the server does not look at them; naive serde, no compression).

A store returns before its remote PUTs are sent (they run on the engine's event loop), so a save
is timed until the RemoteBackend has no PUT in flight and an EXIST of the last chunk, on the same
connection, answers that the server holds it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.standalone.__main__ import LMCacheStandaloneStarter, parse_kvcache_shape_spec

HEAD = 224  # float16 values per token per K or V: 4 * HEAD bytes a token
FLUSH_TIMEOUT_S = 60.0


class EngineClient:
    """One LMCacheEngine (standalone, remote only) and one session of ``n_chunks`` chunks."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        ct, n = cmd["chunk_tokens"], cmd["n_chunks"]
        self.chunk_bytes = 4 * ct * HEAD
        gb = (3 * n * self.chunk_bytes + (64 << 20)) / 2**30
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=ct, local_cpu=False, max_local_cpu_size=gb,
                                                remote_url=f"lm://127.0.0.1:{cmd['port']}", remote_serde="naive",
                                                save_unfull_chunk=False)
        shape = (1, 2, ct, 1, HEAD)
        md = LMCacheMetadata(model_name=f"engine{cmd['idx']}-{ct}", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.float16, kv_shape=shape, role="worker")
        self.starter = LMCacheStandaloneStarter(cfg, md, parse_kvcache_shape_spec(f"({','.join(map(str, shape))})"
                                                                                  ":float16:1"), "cpu")
        self.engine = self.starter.start()
        self.tokens = torch.arange(n * ct) + cmd["idx"] * 1_000_003  # distinct prefixes per client
        self.slots = torch.arange(n * ct)
        self.remote = self.engine.storage_manager.storage_backends["RemoteBackend"]
        self.last_key = [k for _, _, k in self.engine.token_database.process_tokens(self.tokens)][-1]

    def save(self) -> None:
        self.engine.store(self.tokens, kvcaches=self.starter.kv_caches, slot_mapping=self.slots)
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while self.remote.put_tasks:
            if time.monotonic() > deadline:
                raise RuntimeError("LMCache's remote PUTs did not finish")
            time.sleep(0.0002)
        if not self.remote.contains(self.last_key):
            raise RuntimeError("lmcache_server does not hold the last chunk after the engine's store")

    def load(self) -> None:
        got = self.engine.retrieve(self.tokens, kvcaches=self.starter.kv_caches, slot_mapping=self.slots)
        if int(got.sum()) != len(self.tokens):
            raise RuntimeError(f"the engine retrieved {int(got.sum())} of {len(self.tokens)} tokens")

    def close(self) -> None:
        self.starter.stop()
