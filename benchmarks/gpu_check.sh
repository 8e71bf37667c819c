#!/usr/bin/env bash
# The one prepared GPU check (docs/gpu.md): build the extensions, run tests/test_gpu.py, print the
# throughput table of benchmarks/gpu_check.py. Needs a CUDA GPU and cupy; about 3 minutes on one
# GPU. Results go to $OUT when it is set (test log, build log, gpu_check.{json,md}).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#
# Offline machines: pure-Python dependencies missing from the interpreter (anyio, trio, pytest,
# pytest-timeout, Cython) are unpacked from .gpu-wheels/ (made by scripts/gpu-wheels.sh) into
# .gpu-deps/ and put first on PYTHONPATH. Nothing is installed system-wide.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-}
LOGDIR=${OUT:-$(mktemp -d)}
mkdir -p "$LOGDIR"
say() { echo "== $*" | tee -a "$LOGDIR/summary.txt"; }
start=$(date +%s)

say "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
if ! $PY -c 'import cupy, sys; ok = cupy.cuda.is_available(); print("cupy", cupy.__version__, "GPU usable:", ok); sys.exit(0 if ok else 1)' 2>&1 | tee -a "$LOGDIR/summary.txt"; then
  say "no usable GPU through cupy: nothing to check here"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee -a "$LOGDIR/summary.txt" || true

missing=$($PY -c 'import importlib.util as u; print(" ".join(m for m in ["anyio", "trio", "numpy", "pytest", "pytest_timeout", "Cython"] if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
  if [ -d .gpu-wheels ]; then
    say "missing: $missing -> unpacking .gpu-wheels into .gpu-deps"
    $PY - <<'EOF'
import pathlib, zipfile
dest = pathlib.Path(".gpu-deps")
dest.mkdir(exist_ok=True)
for whl in sorted(pathlib.Path(".gpu-wheels").glob("*.whl")):
    zipfile.ZipFile(whl).extractall(dest)
EOF
    export PYTHONPATH="$PWD/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"
  else
    say "missing: $missing and no .gpu-wheels/ (run scripts/gpu-wheels.sh where PyPI is reachable)"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

say "build"
if $PY setup.py build_ext --inplace -q >"$LOGDIR/build.log" 2>&1; then
  say "built: $(ls mooncake/_fast/*.so 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
else
  say "build failed (the ctypes and cupy backends still work); last lines:"
  tail -5 "$LOGDIR/build.log" | tee -a "$LOGDIR/summary.txt"
fi
$PY -c 'from mooncake._fast import cuda; rt = cuda.runtime(); print("runtime backend:", rt.backend, "devices:", rt.get_device_count())' 2>&1 | tee -a "$LOGDIR/summary.txt"

say "tests/test_gpu.py"
timeout 200 $PY -m pytest tests/test_gpu.py -q -rs -p no:cacheprovider 2>&1 | tee "$LOGDIR/test_gpu.txt" | tail -25
tests_rc=${PIPESTATUS[0]}
say "tests rc=$tests_rc"

say "completion bridge"
timeout 60 $PY benchmarks/cuda_bridge.py 2>&1 | tee "$LOGDIR/bridge.txt"

say "throughput"
timeout 150 $PY benchmarks/gpu_check.py --seconds 0.2 ${OUT:+--out "$OUT"} 2>&1 | tee "$LOGDIR/bench.txt"
bench_rc=${PIPESTATUS[0]}
say "bench rc=$bench_rc, total $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
