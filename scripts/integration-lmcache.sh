#!/usr/bin/env bash
# Build (once; cached) a venv with LMCache's own code and run its Mooncake store connector and
# Mooncake transfer channel against this checkout's `mooncake` package (first on PYTHONPATH, so
# it replaces the published name there).
#   bash scripts/integration-lmcache.sh           # build if needed, run every check
#   bash scripts/integration-lmcache.sh channel   # one check: store | channel
#   MOONCAKE_LMCACHE_VENV=DIR                     # where the venv lives (default ~/.cache/...)
# lmcache 0.5.6 asks for cupy-cuda13x, cuda-python, grpcio, google-cloud-bigtable, redis,
# opentelemetry and more: it is installed with --no-deps over the CPU torch 2.13.0 wheel that
# pip finds on these machines, plus what its connector and channel modules import.
# Takes ~2 min to build (~1.5 GB venv) and ~20 s per check on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MOONCAKE_LMCACHE_VENV:-$HOME/.cache/mooncake-lmcache-venv}"
log() { echo "[integration-lmcache] $*"; }
pip_() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@"; }
probe="import lmcache.v1.storage_backend.connector.mooncakestore_connector, lmcache.v1.distributed.transfer_channel.impl.mooncake_te_impl"
here="$PWD"
if [ ! -x "$VENV/bin/python" ] || ! (cd /tmp && PYTHONPATH="$here" "$VENV/bin/python" -c "$probe") 2>/dev/null; then
  log "building $VENV (torch 2.13.0 CPU, lmcache 0.5.6 --no-deps)"
  python3 -m venv "$VENV"
  pip_ torch==2.13.0
  pip_ --no-deps lmcache==0.5.6
  # what the connector's and the channel's import chains need (lmcache's own pins kept)
  pip_ "numpy<=2.2.6" numba msgspec pyzmq sortedcontainers pyyaml psutil requests cachetools \
    py-cpuinfo aiohttp aiofile "transformers>=5.4" cryptography "prometheus-client<=0.24.1"
fi
# this package's own runtime dependencies (the package itself comes from PYTHONPATH)
pip_ anyio trio msgspec httpx h11 rich "prometheus-client<=0.24.1" regex
. scripts/_integration_common.sh
ensure_hot_path
RESULTS="$(results_dir lmcache)"
log "results in $RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
checks=("$@")
[ ${#checks[@]} -gt 0 ] || checks=(store channel)
for check in "${checks[@]}"; do
  log "running $check"
  "$VENV/bin/python" "tests/integration/lmcache_${check}.py" --json "$RESULTS/${check}.json" || status=1
done
exit $status
