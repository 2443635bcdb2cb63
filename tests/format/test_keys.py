from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.format.keys import ROOT, chain_keys, chunk_key
from kvstore.format.layout import get_layout

LAY = get_layout("tiny-16").layout_id
SCRIPT = (
    "import numpy as np; from kvstore.format.keys import chain_keys; from kvstore.format.layout import get_layout;"
    "ids = np.random.default_rng(7).integers(0, 50000, 4096);"
    "print(','.join(k.hex() for k in chain_keys(get_layout('tiny-16').layout_id, 'team-a', ids, 256)))"
)


def test_keys_agree_across_processes_and_hash_seeds() -> None:
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    ids = np.random.default_rng(7).integers(0, 50000, 4096)
    assert outs.pop() == ",".join(k.hex() for k in chain_keys(LAY, "team-a", ids, 256))


def test_chain_depends_on_whole_prefix_namespace_and_layout() -> None:
    a = np.arange(1024)
    b = a.copy()
    b[3] = 99999
    ka, kb = chain_keys(LAY, "ns", a, 256), chain_keys(LAY, "ns", b, 256)
    assert len(ka) == 4 and all(x != y for x, y in zip(ka, kb))  # a change early changes every later key
    assert chain_keys(LAY, "other", a, 256)[0] != ka[0]
    assert chain_keys(get_layout("tiny-8").layout_id, "ns", a, 256)[0] != ka[0]
    assert ka[1] == chunk_key(LAY, "ns", ka[0], a[256:512])
    assert ka[0] == chunk_key(LAY, "ns", ROOT, a[:256])
    assert chain_keys(LAY, "ns", a[:1000], 256) == ka[:3]  # a partial chunk has no key
    assert all(len(k) == 16 for k in ka)


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        chain_keys(LAY, "ns", [1, 2, 3], 0)
    with pytest.raises(ValueError, match="uint32"):
        chunk_key(LAY, "ns", ROOT, [-1])
    with pytest.raises(ValueError, match="16 bytes"):
        chunk_key(b"short", "ns", ROOT, [1])
