#!/usr/bin/env bash
# Download the pure-Python wheels benchmarks/gpu_check.sh needs on a GPU machine without network
# (anyio, trio, pytest + plugin, Cython, setuptools and their dependencies) into .gpu-wheels/.
# Run on a machine with PyPI access, then carry .gpu-wheels to the GPU machine (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .gpu-wheels
for pyv in 3.10 3.12; do
  "$PY" -m pip download --quiet --dest .gpu-wheels --only-binary=:all: --python-version "$pyv" \
    --platform any --implementation py \
    anyio trio pytest pytest-timeout cython setuptools exceptiongroup tomli
done
ls .gpu-wheels
