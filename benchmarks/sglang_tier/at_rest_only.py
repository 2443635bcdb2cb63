"""The SGLang benchmark's bytes-at-rest part alone (bench_sglang_tier.run_at_rest: a 128K-token session of
real quantized V4.1 pages stored by a daemon with each ssd-record setting, sized by ``du``, then a cold load
checked after a restart with the page cache dropped), for the record settings of AT_REST_FLAGS.

    PYTHONPATH=. .venv-sglang/bin/python benchmarks/sglang_tier/at_rest_only.py [--pages 512] [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_sglang_tier as b


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="at_rest_only.", dir="/work" if Path("/work").is_dir() else None))
    try:
        probe = b.engine_of("file", work / "probe", "", 16)
        pages = b.RealPages(probe)
        probe.close()
        for _ in range(args.reps):
            for flags in ((), *b.AT_REST_FLAGS):
                print(json.dumps(b.run_at_rest(flags, pages, args.pages, work)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
