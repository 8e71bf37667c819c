#!/usr/bin/env bash
# Set up everything the test suite uses, idempotently, on a fresh Debian machine:
#   system packages (etcd, redis, iproute2, iperf3, libibverbs for the published wheel and
#   its headers for the verbs ABI check),
#   the project venv in .venv with the package built in place (editable) and its test extras,
#   the published Mooncake wheel in its own venv (for the interop tests and side-by-side benches).
# Usage: bash scripts/setup-dev.sh [--no-system] [--no-anchor]
set -euo pipefail
cd "$(dirname "$0")/.."

system=1; anchor=1
for a in "$@"; do
  case "$a" in
    --no-system) system=0 ;;
    --no-anchor) anchor=0 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done

log() { echo "[setup] $*"; }

APT_PKGS=(etcd-server etcd-client redis-server iproute2 iperf3 libibverbs1 libibverbs-dev libnuma1 libcurl4)
if [ "$system" = 1 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # the Debian packages start their own daemons; the tests start private instances instead
    for svc in etcd redis-server; do
      (command -v systemctl >/dev/null && systemctl stop "$svc" 2>/dev/null) || true
      (command -v service >/dev/null && service "$svc" stop >/dev/null 2>&1) || true
    done
  else
    log "system packages present"
  fi
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -U pip setuptools wheel 2>&1 | grep -v "is ignored" || true
log "pip install -e .[dev]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import mooncake, mooncake._fast as f; print('[setup] mooncake', mooncake.__version__, 'compiled hot path:', f.COMPILED)"

# the tensor methods' optional dependency: the CPU build (other versions pull CUDA wheels)
.venv/bin/python -c "import torch" 2>/dev/null \
  || .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true

if [ "$anchor" = 1 ]; then
  log "published Mooncake wheel (anchor venv)"
  bash scripts/setup-anchor.sh "${MOONCAKE_ANCHOR_VENV:-$HOME/.cache/mooncake-anchor-venv}" 2>&1 \
    | grep -E "^\[setup\]" | sed 's/^\[setup\]/[setup] anchor:/' \
    || log "anchor setup failed: interop tests will skip"
fi
log "done"
