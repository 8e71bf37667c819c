#!/usr/bin/env bash
# Run the RDMA tests against real RNICs through the system libibverbs (not the soft provider).
# Usage: bash scripts/rdma-hw-suite.sh DEV[,DEV2]      e.g. mlx5_0,mlx5_1 (see `ibv_devices`)
# Env: MC_GID_INDEX (RoCE: the GID index to use, see `show_gids`), PYTHON (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
devs="${1:?usage: $0 DEV[,DEV2] (names from ibv_devices)}"
PY="${PYTHON:-.venv/bin/python}"

echo "[rdma-hw] devices: $devs"
command -v ibv_devinfo >/dev/null && ibv_devinfo -l || echo "[rdma-hw] ibv_devinfo not found (apt-get install ibverbs-utils)"
for d in ${devs//,/ }; do
  if command -v ibv_devinfo >/dev/null && ! ibv_devinfo -d "$d" | grep -q PORT_ACTIVE; then
    echo "[rdma-hw] $d has no ACTIVE port" >&2; exit 1
  fi
done
memlock=$(ulimit -l)
if [ "$memlock" != "unlimited" ] && [ "$memlock" -lt 1048576 ]; then
  echo "[rdma-hw] warning: ulimit -l is ${memlock} KiB; MR registration may fail (ulimit -l unlimited)" >&2
fi

unset MOONCAKE_IBVERBS MC_SOFTVERBS_DEVICES MC_SOFTVERBS_FABRIC MC_SOFTVERBS_LINK_LAYER
"$PY" setup.py build_ext --inplace -q
"$PY" -m pytest tests/test_verbs_abi.py -q -rs
# the transport tests post through the compiled batch engine (_rdma_batch): WR chains with
# selective signaling, the same code as on the soft provider
MC_RDMA_TEST_DEVICES="$devs" "$PY" -m pytest tests/test_verbs_soft.py tests/test_rdma_transport.py \
    tests/test_rdma_batch.py -q -rs
