#!/usr/bin/env bash
# The GPU tests and the GPU benchmark in one run, on a CUDA machine:
#   scripts/gpu_check.sh [OUT_DIR]     # logs, gpu.md and gpu.json -> OUT_DIR (default benchmarks/results)
# A machine without registry access (the device machine) installs the wheels carried in .whl/ first.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
tests=(tests/format/test_cuda_codecs.py tests/tiers/test_hbm_alloc.py tests/tiers/test_hbm_tier.py tests/client/test_cuda_ipc.py
       tests/client/test_device_load.py tests/client/test_load_into.py tests/bench/test_geometry_gpu.py
       tests/replay/test_fast_decode.py tests/format/test_quant.py tests/replay/test_model.py)
python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 300 "${tests[@]}" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 benchmarks/gpu/bench_gpu.py --out "$out" "${@:2}" 2>&1 | tee "$out/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
