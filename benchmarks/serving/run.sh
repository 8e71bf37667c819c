#!/usr/bin/env bash
# The serving evaluation (docs/eval.md): `mooncake eval` with the vLLM venv that
# scripts/integration-vllm.sh builds, into a fresh run directory. Extra arguments go to
# `mooncake eval` (e.g. --scenarios local,store,pd,pd_store,store_fault --models llama,qwen2).
#   bash benchmarks/serving/run.sh [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${MOONCAKE_VLLM_VENV:-$HOME/.cache/mooncake-vllm-venv}"
log() { echo "[serving-eval] $*"; }
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  log "no vLLM venv at $VENV: run scripts/integration-vllm.sh first (it builds one)"
  exit 1
fi
. scripts/_integration_common.sh
ensure_hot_path
OUT="${MOONCAKE_RESULTS_DIR:-eval-runs/$(date -u +%Y%m%dT%H%M%SZ)-$$}"
log "run directory $OUT"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" -m mooncake eval \
  --vllm-python "$VENV/bin/python" --out "$OUT" "$@"
