#!/usr/bin/env bash
# Wall time of the two test passes of .ci/run (setup excluded), optionally beside a CPU hog.
#
#   bash benchmarks/ci_wall.sh [--hog N] [--python PY] [--workers W] [-- extra pytest args]
#
# --hog N runs `stress-ng --cpu N` for the whole measurement (stopped by its pid at the end).
# Prints the load average before and after each pass, each pass's summary line and wall time,
# and keeps the full output (with --durations=40) under ${OUT:-/tmp/mooncake-ci-wall}.
set -uo pipefail
cd "$(dirname "$0")/.."
hog=0; py=.venv/bin/python; workers="$(nproc)"; extra=()
while (($#)); do
  case "$1" in
    --hog) hog="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out="${OUT:-/tmp/mooncake-ci-wall}"; mkdir -p "$out"
hog_pid=""
if [ "$hog" -gt 0 ]; then
  stress-ng --cpu "$hog" --timeout 7200 >/dev/null 2>&1 &
  hog_pid=$!
fi
trap '[ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null' EXIT
xdist=(-n "$workers" --dist worksteal)
if [ "$workers" = 0 ]; then xdist=(-p no:xdist); fi
status=0
run_pass() {  # name, env assignment or "", pytest args...
  local name="$1" envset="$2"; shift 2
  echo "== $name: $(uptime | sed 's/.*load/load/')"
  local t0; t0=$(date +%s)
  env $envset "$py" -m pytest -p no:cacheprovider "${xdist[@]}" --durations=40 "$@" "${extra[@]}" \
    >"$out/$name.txt" 2>&1
  local rc=$?
  ((rc)) && status=$rc
  echo "   rc=$rc wall=$(( $(date +%s) - t0 )) s: $(grep -E '^[0-9]+ (passed|failed)|[0-9]+ passed' "$out/$name.txt" | tail -1)"
  grep -E "^(FAILED|ERROR) " "$out/$name.txt" | sed 's/^/   /'
  echo "   after: $(uptime | sed 's/.*load/load/')"
}
run_pass compiled ""
run_pass pure "MOONCAKE_NO_EXTENSIONS=1" -m "not slow and not twin_independent"
exit "$status"
