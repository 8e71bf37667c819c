#!/usr/bin/env bash
# Make an include directory with rdma-core's verbs headers as pyverbs ships them (its PyPI sdist
# bundles the rdma-core tree it is built from), for tests/test_verbs_abi.py:
#   MC_RDMA_CORE_INCLUDE=$(bash scripts/rdma-core-headers.sh) python -m pytest tests/test_verbs_abi.py
# Usage: bash scripts/rdma-core-headers.sh [PYVERBS_VERSION] [DIR]   (default 59.0, a temp dir)
set -euo pipefail
ver="${1:-59.0}"
dir="${2:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
"$PY" -m pip download --quiet --no-deps --no-binary pyverbs "pyverbs==$ver" -d "$dir" >&2
tar -xzf "$dir/pyverbs-$ver.tar.gz" -C "$dir"
src="$dir/pyverbs-$ver/rdma-core"
inc="$dir/include"
mkdir -p "$inc/infiniband" "$inc/rdma"
# the installed layout: infiniband/ holds libibverbs' headers, rdma/ the kernel uapi ones
ln -sf "$src"/libibverbs/*.h "$inc/infiniband/"
ln -sf "$src"/kernel-headers/rdma/*.h "$inc/rdma/"
ln -sf "$src"/kernel-headers/rdma/ib_user_ioctl_verbs.h "$inc/infiniband/"
echo "$inc"
