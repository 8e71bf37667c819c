#!/usr/bin/env bash
# Device memory through the C ABI (docs/integrations.md, TensorRT-LLM): build the extensions and
# libtransfer_engine.so, compile tests/c/gpu_register.c with cc against them, run it with the
# device registered as "cuda:0" and as "*". Needs a CUDA GPU (libcudart); about a minute.
# Logs go to $OUT when it is set.
#
#   OUT=/tmp/gpu-cabi bash benchmarks/gpu_check_cabi.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGDIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOGDIR"
say() { echo "== $*" | tee -a "$LOGDIR/summary.txt"; }
say "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee -a "$LOGDIR/summary.txt" || true
if ! $PY setup.py build_ext --inplace >"$LOGDIR/build.log" 2>&1; then
  say "build failed (see build.log)"; exit 1
fi
LIB=mooncake/_fast/lib
[ -f $LIB/libtransfer_engine.so ] || { say "libtransfer_engine.so not built (no shared libpython?)"; exit 1; }
CUDA_LIB=$($PY - <<'PYEOF'
import glob, os
c = [os.path.dirname(p) for p in glob.glob("/usr/local/cuda*/lib64/libcudart.so*")]
c += [os.path.dirname(p) for p in glob.glob("/usr/lib/x86_64-linux-gnu/libcudart.so*")]
print(c[0] if c else "")
PYEOF
)
export LD_LIBRARY_PATH="${CUDA_LIB:+$CUDA_LIB:}${LD_LIBRARY_PATH:-}"
cc -O1 -Wall -std=gnu11 -Imooncake/_fast/include tests/c/gpu_register.c -o "$LOGDIR/gpu_register" \
  -L$LIB -Wl,-rpath,$PWD/$LIB -ltransfer_engine -ldl || { say "compile failed"; exit 1; }
rc=0
for loc in "cuda:0" "*"; do
  MOONCAKE_PYTHON=$($PY -c 'import sys; print(sys.executable)') timeout 300 "$LOGDIR/gpu_register" "$loc" \
    >>"$LOGDIR/run.log" 2>&1
  r=$?
  say "location $loc: exit $r ($(grep -c FAIL "$LOGDIR/run.log") FAIL lines so far)"
  [ $r -eq 0 ] || rc=1
done
tail -5 "$LOGDIR/run.log"
exit $rc
