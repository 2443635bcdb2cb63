#!/usr/bin/env bash
# Install kvstore into ./.venv (or $KVSTORE_VENV), editable.
#   scripts/install.sh          kvstore[replay]: the daemon, the CLI, the client, and what `kvstore demo`
#                               needs (torch, safetensors; the trained checkpoint is in the checkout)
#   scripts/install.sh --dev    kvstore[dev]: the above + test, lint and benchmark tools, and triton, also on
#                               a CPU-only host (~1 GB): tests/format/test_cuda_codecs.py runs the CUDA codec kernels
#                               under Triton's interpreter there, their only check without a GPU
# (`pip install kvstore` alone gives the daemon, the CLI and the client without torch.)
# torch is installed first, chosen for this host: without an NVIDIA GPU we pin the CPU wheel
# (KVSTORE_TORCH, default torch==2.13.0; add KVSTORE_TORCH_INDEX to pull it from a CPU-only
# index), so pip never downloads a multi-GB CUDA build a CPU host cannot use. With a GPU, the
# default PyPI torch (a CUDA build, which brings triton itself) is used. A torch that is already
# importable is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSTORE_VENV:-.venv}"
case "${1:-}" in
  "") extras="[replay]" ;;
  --dev) extras="[dev]" ;;
  *) echo "usage: scripts/install.sh [--dev]" >&2; exit 2 ;;
esac

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
# The test suite drives the daemon from a stock Node.js gRPC client too (tests/server/test_node_client.py).
if [[ "$extras" == "[dev]" ]] && command -v npm >/dev/null 2>&1; then
  npm ci --prefix tests/node --no-audit --no-fund --loglevel=error >/dev/null
fi
echo "kvstore installed in $venv ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
