"""`kvstore demo`: the main job, end to end, on this machine."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from cli.ui import console
from kvstore import chunk, quant
from kvstore.keys import chain_keys
from kvstore.layout import get_layout


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run a session end to end and print hits, sizes and bytes/token")
    p.add_argument("--layout", default="tiny-16")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    con = console()
    lay = get_layout(args.layout)
    g = torch.Generator().manual_seed(0)
    ids = np.random.default_rng(0).integers(0, 256, args.tokens)
    keys = chain_keys(lay.layout_id, "demo", ids, args.chunk_tokens)
    t0 = time.perf_counter()
    blobs = []
    for i, key in enumerate(keys):
        lo = i * args.chunk_tokens
        ents = {}
        for c in lay.caches:
            x = torch.randn(c.entries_for(args.chunk_tokens), c.channels, generator=g)
            q = quant.quantize_main(x) if c.fmt.block == 16 else quant.quantize_indexer(x)
            ents[c.name] = chunk.Entries.of(*q)
        blobs.append(chunk.encode(lay, key=key, start=lo, token_ids=ids[lo : lo + args.chunk_tokens],
                                  entries=ents))
    with tempfile.TemporaryDirectory() as d:
        for key, blob in zip(keys, blobs):
            (Path(d) / key.hex()).write_bytes(blob)
        stored = sum(p.stat().st_size for p in Path(d).iterdir())
        ok = 0
        for i, key in enumerate(keys):
            c = chunk.decode((Path(d) / key.hex()).read_bytes(), lay)
            lo = i * args.chunk_tokens
            ok += int(c.key == key and np.array_equal(c.token_ids, ids[lo : lo + args.chunk_tokens]))
    dt = time.perf_counter() - t0
    tokens = len(keys) * args.chunk_tokens
    t = Table("what", "value", title=f"kvstore demo: {lay.name}, {tokens:,} tokens in {len(keys)} chunks")
    t.add_row("chunks verified on read", f"{ok}/{len(keys)}")
    t.add_row("formula bytes/token", f"{float(lay.bytes_per_token):,.2f}")
    t.add_row("measured bytes/token (chunks on disk)", f"{stored / tokens:,.2f}")
    t.add_row("overhead vs formula", f"{(stored / tokens / float(lay.bytes_per_token) - 1) * 100:.2f}%")
    t.add_row("time", f"{dt:.2f} s")
    con.print(t)
    return 0 if ok == len(keys) else 1
