#!/usr/bin/env bash
# The GPU check from the repository root (see benchmarks/gpu/check.py and docs/gpu.md):
#   bash benchmarks/gpu/check.sh                 # on the CUDA machine, .gpu-bundle carried
#   bash benchmarks/gpu/check.sh --cpu --no-build
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m benchmarks.gpu.check "$@"
