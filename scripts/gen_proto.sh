#!/usr/bin/env bash
# Regenerate the Python gRPC modules from proto/ into kvstore/v1/ (committed, so installs need no
# protoc). Run after editing proto/kvstore/v1/kvstore.proto. Needs grpcio-tools (`install.sh --dev`).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
"$py" -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/kvstore/v1/kvstore.proto
touch kvstore/v1/__init__.py
echo "generated: $(ls kvstore/v1/*.py* | tr '\n' ' ')"
