#!/usr/bin/env bash
# Set up everything the test suite uses, idempotently, on a fresh Debian machine:
#   system packages (etcd, redis, iproute2, iperf3, libibverbs for the published wheel and
#   its headers for the verbs ABI check),
#   the project venv in .venv with the package built in place (editable) and its test extras
#   (a second run only rebuilds changed extensions and reinstalls when pyproject.toml or
#   setup.py changed: a few seconds),
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
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# run "$@" without pip's notes about unreachable extra indexes, keeping its exit status
quiet() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
  quiet "${PIP[@]}" -U pip setuptools wheel
fi
# the build requirements live in the venv, so the editable install below needs no isolated
# build environment (which pip would otherwise make anew, downloads included, every time)
.venv/bin/python -c "import Cython, numpy, setuptools" 2>/dev/null \
  || quiet "${PIP[@]}" "setuptools>=77" wheel "cython>=3.0" "numpy>=1.26"

# the package (editable, which builds the compiled hot path in place) and its dependencies:
# only when their declarations changed; otherwise only the extensions whose sources changed
# since their .so was built are rebuilt, in parallel (a few seconds when none did)
stamp=".venv/.mooncake-py-deps-$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  log "pip install -e .[dev]"
  quiet "${PIP[@]}" --no-build-isolation -e '.[dev]'
  rm -f .venv/.mooncake-py-deps-*
  touch "$stamp"
else
  log "dependencies present (pyproject.toml and setup.py unchanged); build_ext --inplace"
  .venv/bin/python setup.py -q build_ext --inplace -j "$(nproc)" 2>&1 \
    | { grep -vE "^\[[0-9]+/[0-9]+\] Cythonizing|skipping .* up-to-date|is ignored" || true; }
fi
.venv/bin/python -c "import mooncake, mooncake._fast as f; print('[setup] mooncake', mooncake.__version__, 'compiled hot path:', f.COMPILED)"

# the tensor methods' optional dependency: the CPU build (other versions pull CUDA wheels)
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" \
  || quiet "${PIP[@]}" torch==2.13.0

if [ "$anchor" = 1 ]; then
  log "published Mooncake wheel (anchor venv)"
  bash scripts/setup-anchor.sh "${MOONCAKE_ANCHOR_VENV:-$HOME/.cache/mooncake-anchor-venv}" 2>&1 \
    | grep -E "^\[setup\]" | sed 's/^\[setup\]/[setup] anchor:/' \
    || log "anchor setup failed: interop tests will skip"
fi
log "done"
