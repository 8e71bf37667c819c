# Sourced by scripts/integration-*.sh (after `cd` to the checkout and VENV/log set).
#   ensure_hot_path   the venv must import this checkout's compiled hot path (mooncake._fast's
#                     COMPILED/TCP_COMPILED/COPYQ_COMPILED/INTMAP_COMPILED): builds the extensions
#                     in place with the venv's python when they are missing, then fails loudly
#                     (exit 1) if the pure-Python twins would still be loaded
#   results_dir NAME  a fresh per-run directory for the checks' JSON (MOONCAKE_RESULTS_DIR, else
#                     a new mktemp directory), printed on stdout
_hot_path_probe='import mooncake._fast as f, sys; missing = [n for n in ("COMPILED", "TCP_COMPILED", "COPYQ_COMPILED", "INTMAP_COMPILED") if not getattr(f, n, False)]; print("compiled hot path:", "missing " + ",".join(missing) if missing else "all compiled", "from", f.__file__); sys.exit(1 if missing else 0)'

ensure_hot_path() {
  if env -u MOONCAKE_NO_EXTENSIONS PYTHONPATH="$PWD" "$VENV/bin/python" -c "$_hot_path_probe"; then
    return 0
  fi
  log "building the compiled hot path in place with $VENV/bin/python"
  "$VENV/bin/pip" install -q --disable-pip-version-check "cython>=3.0" "setuptools>=77" wheel numpy
  "$VENV/bin/python" setup.py -q build_ext --inplace -j 2
  if ! env -u MOONCAKE_NO_EXTENSIONS PYTHONPATH="$PWD" "$VENV/bin/python" -c "$_hot_path_probe"; then
    log "ERROR: $VENV would run the pure-Python twins of mooncake._fast; refusing to measure them"
    exit 1
  fi
}

results_dir() {
  local dir="${MOONCAKE_RESULTS_DIR:-}"
  if [ -z "$dir" ]; then
    dir="$(mktemp -d "${TMPDIR:-/tmp}/mooncake-$1-XXXXXXXX")"
  else
    mkdir -p "$dir"
  fi
  echo "$dir"
}
