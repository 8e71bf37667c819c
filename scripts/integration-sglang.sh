#!/usr/bin/env bash
# Build (once; cached) a venv with SGLang's own code (no GPU stack) and run SGLang's Mooncake
# HiCache backend and PD transfer wrapper against this checkout's `mooncake` package (first on
# PYTHONPATH, so it replaces the published name there).
#   bash scripts/integration-sglang.sh            # build if needed, run every check
#   bash scripts/integration-sglang.sh pd         # one check: hicache | pd
#   MOONCAKE_SGLANG_VENV=DIR                      # where the venv lives (default ~/.cache/...)
# sglang 0.5.23 pins torch 2.14.1 (CUDA) and ~70 GPU/serving packages: it is installed with
# --no-deps over the CPU torch 2.13.0 wheel that pip finds on these machines, plus the few
# pure-Python packages its Mooncake modules import (and triton, which imports without a GPU).
# Takes ~2 min to build (~2.3 GB venv, most of it torch and triton) and ~20 s per check on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOONCAKE_SGLANG_VENV:-$HOME/.cache/mooncake-sglang-venv}"
log() { echo "[integration-sglang] $*"; }
pip_() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@"; }
# (importing `sglang` itself would run its package __init__, which the checks skip)
probe="import importlib.metadata as m, torch, triton, pydantic, orjson, zmq; assert m.version('sglang') == '0.5.23'"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "$probe" 2>/dev/null; then
  log "building $VENV (torch 2.13.0 CPU, sglang 0.5.23 --no-deps)"
  python3 -m venv "$VENV"
  pip_ torch==2.13.0
  pip_ --no-deps sglang==0.5.23 triton==3.9.0
  # what sglang.srt.utils.common, environ, runtime_context and utils.network import
  pip_ orjson pybase64 packaging pillow starlette pyzmq pydantic requests psutil numpy
fi
# this package's own runtime dependencies (the package itself comes from PYTHONPATH)
pip_ anyio trio msgspec httpx h11 rich prometheus-client regex
. scripts/_integration_common.sh
ensure_hot_path
RESULTS="$(results_dir sglang)"
log "results in $RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(hicache pd)
for check in "${checks[@]}"; do
  log "running $check"
  "$VENV/bin/python" "tests/integration/sglang_${check}.py" --json "$RESULTS/${check}.json" || status=1
done
exit $status
