"""GPU sections (one module each, ``run() -> (markdown, dict)``) and bench_gpu.py, which runs them."""
