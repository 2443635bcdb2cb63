#!/usr/bin/env bash
# Install kvstore into ./.venv (or $KVSTORE_VENV).
#   scripts/install.sh          runtime install
#   scripts/install.sh --dev    runtime + test/lint/benchmark tools
# torch is installed first, chosen for this host: without an NVIDIA GPU we pin the CPU wheel
# (KVSTORE_TORCH, default torch==2.13.0; add KVSTORE_TORCH_INDEX to pull it from a CPU-only
# index), so pip never downloads a multi-GB CUDA build a CPU host cannot use. With a GPU, the
# default PyPI torch (a CUDA build) is used. A torch that is already importable is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_VENV:-.venv}"
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip >/dev/null

if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install --quiet "${KVSTORE_TORCH_GPU:-torch>=2.4}"
  else
    idx=()
    [[ -n "${KVSTORE_TORCH_INDEX:-}" ]] && idx=(--index-url "$KVSTORE_TORCH_INDEX")
    "$py" -m pip install --quiet "${idx[@]}" "${KVSTORE_TORCH:-torch==2.13.0}"
  fi
fi
"$py" -m pip install --quiet -e ".${extras}"
# The test suite drives the daemon from a stock Node.js gRPC client too (tests/test_node_client.py).
if [[ -n "$extras" ]] && command -v npm >/dev/null 2>&1; then
  npm ci --prefix tests/node --no-audit --no-fund --loglevel=error >/dev/null
fi
echo "kvstore installed in $venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
