#!/usr/bin/env bash
# The SGLang environment the HiCache L3 tests (tests/engines/sglang_tier/) run in: ./.venv-sglang (git-ignored),
# never the default install. SGLang's Python side on a CPU machine: the CPU torch, SGLang 0.5.23 without its
# dependencies (they pin a CUDA torch and CUDA kernels), the packages the imports of its memory pools, HiCache
# controller, storage backends and server args need, then kvstore itself (editable) and pytest.
#   scripts/sglang_env.sh            build it (idempotent: an environment that passes the probe is kept)
# Override the interpreter with PYTHON, the location with KVSTORE_SGLANG_VENV, the torch pin with KVSTORE_TORCH.
# Never add torchvision (or a plain torch from PyPI): they pull a multi-GB CUDA build. SGLang's config package
# imports torchvision.transforms at import time; the tests stand in for it (tests/engines/sglang_tier/cpu_shims.py).
# Needs a C++ compiler and the OpenSSL headers: SGLang's HiCache page keys come from a C++ extension it builds
# on first use (srt/mem_cache/cpp_utils/hash_binding.cpp); the probe builds it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_SGLANG_VENV:-.venv-sglang}"
SGLANG_VERSION="0.5.23"   # the version the HiCache L3 backend is tested against
torch_pin="${KVSTORE_TORCH:-torch==2.13.0}"
probe="import sys; sys.path.insert(0, 'tests/engines/sglang_tier'); import cpu_shims; cpu_shims.install()
import sglang, sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler, sglang.srt.mem_cache.deepseek_v4_memory_pool
import sglang.srt.server_args, sglang.srt.mem_cache.storage, kvstore
from sglang.srt.mem_cache.utils import get_hash_str
assert len(get_hash_str(list(range(512)), None, page_size=256)) == 2
from importlib.metadata import version; print(version('sglang'))"
if [[ -x "$venv/bin/python" ]] && [[ "$("$venv/bin/python" -c "$probe" 2>/dev/null | tail -1)" == "$SGLANG_VERSION" ]]; then
  echo "SGLang $SGLANG_VERSION environment ready in $venv"; exit 0
fi
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip >/dev/null
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_pin"
# keep the CPU torch: a package that wants another torch fails here instead of pulling a CUDA one
constraints="$(mktemp)"; trap 'rm -f "$constraints"' EXIT
"$venv/bin/python" -c "import torch; print('torch==' + torch.__version__)" >"$constraints"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
# SGLang 0.5.23's imports on the memory-pool / HiCache / server-args side, at the versions its metadata pins where
# it pins one; triton and apache-tvm-ffi are imported at module level (both install and import without a GPU)
"${pip[@]}" -c "$constraints" numpy orjson msgspec pydantic psutil pyzmq pyyaml aiohttp requests pillow pybase64 \
  starlette dill gguf IPython "transformers==5.19.0" "kernels>=0.14.1,<0.15" "sentencepiece==0.2.1" \
  "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11" triton ninja
"${pip[@]}" -c "$constraints" -e . pytest pytest-timeout
"$venv/bin/python" -c "$probe" | tail -1 | grep -qx "$SGLANG_VERSION"
echo "SGLang $SGLANG_VERSION environment ready in $venv"
