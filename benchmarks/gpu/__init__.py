"""GPU benchmark sections, one module each, each exposing ``run() -> (markdown, dict)``; the
orchestrator benchmarks/bench_gpu.py runs them on the device machine."""
