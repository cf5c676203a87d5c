#!/usr/bin/env bash
# The GPU check from the repository root (see benchmarks/gpu_check.py and docs/gpu.md):
#   bash benchmarks/gpu_check.sh                 # on the CUDA machine, .gpu-bundle carried
#   bash benchmarks/gpu_check.sh --cpu --no-build
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
