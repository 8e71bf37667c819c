#!/usr/bin/env bash
# Build the published Mooncake wheel's venv (for the interop and differential tests and the
# side-by-side benchmarks), on its own: the Debian libraries its binaries link, a venv with
# mooncake-transfer-engine-non-cuda pinned, numpy and the CPU build of torch. Idempotent.
#
#   bash scripts/setup-anchor.sh [VENV_DIR]
#   (default: $MOONCAKE_ANCHOR_VENV or ~/.cache/mooncake-anchor-venv; MC_VERSION=0.3.13.post1)
#
# The plain mooncake-transfer-engine wheel links libcuda/libcudart and cannot be imported
# without the NVIDIA driver; the -non-cuda wheel is the same code built without CUDA.
set -euo pipefail

VENV_DIR="${1:-${MOONCAKE_ANCHOR_VENV:-$HOME/.cache/mooncake-anchor-venv}}"
MC_VERSION="${MC_VERSION:-0.3.13.post1}"
MC_PACKAGE="mooncake-transfer-engine-non-cuda"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"   # the CPU build pip finds; other versions pull CUDA
log() { echo "[setup] $*"; }

# libibverbs1 is linked by engine.so, store.so and the binaries even for TCP
APT_PKGS=(libibverbs1 libnuma1 libcurl4 libssl3 zlib1g)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x "$VENV_DIR/bin/python" ] || { log "creating venv $VENV_DIR"; python3 -m venv "$VENV_DIR"; }
PY="$VENV_DIR/bin/python"
cd /   # so that `import mooncake` below never finds a checkout of this project
if ! "$PY" -m pip show "$MC_PACKAGE" 2>/dev/null | grep -qx "Version: $MC_VERSION"; then
  log "pip install $MC_PACKAGE==$MC_VERSION numpy"
  "$PY" -m pip install -q --disable-pip-version-check "$MC_PACKAGE==$MC_VERSION" numpy
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  log "pip install torch==$TORCH_VERSION"
  "$PY" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" \
    || log "torch not installed: the tensor comparisons will skip"
fi

PKG_DIR="$("$PY" -c 'import os, mooncake; print(os.path.dirname(mooncake.__file__))')"
for f in engine.so store.so mooncake_master mooncake_client transfer_engine_bench; do
  if ldd "$PKG_DIR/$f" | grep -q "not found"; then
    log "$f has unresolved libraries:"; ldd "$PKG_DIR/$f" | grep "not found"; exit 1
  fi
done
MC_LOG_LEVEL=WARNING "$PY" -c "import mooncake.engine, mooncake.store; print('[setup] import OK')"
log "done: $PY"
