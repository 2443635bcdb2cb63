#!/usr/bin/env bash
# The vLLM environment the tier tests and benchmarks/vllm_tier/bench_vllm_tier.py run in: ./.venv-vllm
# (git-ignored), never the default install. vLLM's Python side on a CPU machine: the CPU torch, vLLM 0.33.0 without its
# dependencies (they pin a CUDA torch), the pure-Python packages its offloading, scheduler and
# KV-cache-interface modules import, then kvstore itself (editable) and pytest.
#   scripts/vllm_env.sh            build it (idempotent: an environment that imports vLLM is kept)
# Override the interpreter with PYTHON, the location with KVSTORE_VLLM_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="0.33.0"   # the version the tier is tested against (kvstore/engines/vllm/tier.py TESTED_VLLM)
probe="import einops, vllm, vllm.v1.kv_offload.tiering.spec, kvstore.engines.vllm.tier; print(vllm.__version__)"
if [[ -x "$venv/bin/python" ]] && [[ "$("$venv/bin/python" -c "$probe" 2>/dev/null | tail -1)" == "$VLLM_VERSION" ]]; then
  echo "vLLM $VLLM_VERSION environment ready in $venv"; exit 0
fi
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip >/dev/null
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "${KVSTORE_TORCH:-torch==2.13.0}"
"${pip[@]}" --no-deps "vllm==$VLLM_VERSION"
# vLLM 0.33.0's imports on the scheduler side, at the versions its metadata pins where it pins one
"${pip[@]}" packaging msgspec pydantic regex cbor2 psutil pyzmq urllib3 "transformers>=5.16.1,<5.21.0" aiohttp \
  requests openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus-client \
  "xgrammar==0.2.8" fastapi partial-json-parser llguidance einops  # einops: the model registry inspects V4.1 with it
"${pip[@]}" -e . pytest pytest-timeout matplotlib
"$venv/bin/python" -c "$probe" | tail -1 | grep -qx "$VLLM_VERSION"
echo "vLLM $VLLM_VERSION environment ready in $venv"
