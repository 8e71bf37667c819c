#!/usr/bin/env bash
# The test suite, twice: with the compiled hot path, then (fast tests only) with the pure-Python
# twins of every compiled function (MOONCAKE_NO_EXTENSIONS=1). Extra arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
echo "== again with the pure-Python twins (MOONCAKE_NO_EXTENSIONS=1, not slow)"
MOONCAKE_NO_EXTENSIONS=1 .venv/bin/python -m pytest -m "not slow" "$@"
