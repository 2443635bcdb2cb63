"""GPU numbers, each beside its ceiling measured in the same run (run on a CUDA machine).

    python benchmarks/gpu/bench_gpu.py [--only codecs,hbm,model] [--out DIR]   # -> benchmarks/results/gpu.md/.json

Sections (one module each under benchmarks/gpu/, each returning its markdown and its figures):
- ``codecs``: the Triton FP4/FP8 codecs vs the device's own copy bandwidth, bit-exact vs the CPU;
- ``hbm``: the HBM tier's put/get vs pinned H2D/D2H, and the same-GPU (CUDA IPC) handoff;
- ``model``: tiny-16 decode and bounded resume vs re-prefill, and a 128K-token real-geometry resume.
A section that fails is reported with its error; the others still run. Without CUDA nothing is
measured (GPU paths are optional; CI has no GPU).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import RESULTS, git_state

SECTIONS = ("codecs", "hbm", "model")


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where gpu.md and gpu.json go")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (GPU paths are optional; see benchmarks/results/gpu.md)")
        return
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    head = (f"Device: {torch.cuda.get_device_name()}, driver {_driver()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, Triton {triton_version}, Python {sys.version.split()[0]}. "
            f"Code: {git_state()}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"
            "Each figure is a median of repeats, synchronized, beside its ceiling measured in the same run.\n")
    parts, data = [head], {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in [s for s in args.only.split(",") if s]:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            text, figures = importlib.import_module(f"benchmarks.gpu.{name}").run()
        except Exception as e:  # one broken section must not cost the others' figures
            traceback.print_exc()
            text, figures = f"## {name}\n\nFAILED: {type(e).__name__}: {e}\n", {"error": repr(e)}
        figures_any: Any = figures
        data[name] = figures_any
        parts.append(text)
        print(text, f"({time.perf_counter() - t0:.0f} s)", flush=True)
    cmd = f"python benchmarks/gpu/bench_gpu.py --only {args.only}" if args.only != ",".join(SECTIONS) else \
        "python benchmarks/gpu/bench_gpu.py"
    parts.append(f"Reproduce on a CUDA machine: `{cmd}` (the GPU tests and this benchmark together: "
                 "`scripts/gpu_check.sh`).")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.md").write_text("# GPU results\n\n" + "\n\n".join(p.strip() for p in parts) + "\n")
    (args.out / "gpu.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {args.out / 'gpu.md'}")


if __name__ == "__main__":
    main()
