#!/usr/bin/env bash
# FlashInfer's norm kernels for the world-size-1 benchmark's `flashinfer` system, prepared on a machine
# that reaches PyPI for a GPU machine that reaches nothing (moe_ar_tools/baselines/flashinfer_norm.py
# says why only these files travel). Writes .baselines/flashinfer/ (git-ignored, about 0.2 MB of
# headers, plus about 2.5 MB where nvcc is here to prebuild the library for sm_90 and sm_100):
#   include/       the include closure of flashinfer/norm.cuh from flashinfer-python's wheel
#   shim/          empty stand-ins for cuBLAS / cuRAND headers that closure includes but never uses
#   VERSION.json   the release, the wheel's sha256, the files, the FP8 scale convention, the library
#   build/         the prebuilt library (when nvcc is here); otherwise the GPU machine builds it (~20 s)
# Usage, from anywhere in the repository:
#   bash moe_ar_tools/baselines/fetch_flashinfer.sh [VERSION]        (default: the pinned release)
#   PYTHON=/path/to/python bash moe_ar_tools/baselines/fetch_flashinfer.sh   (a Python with pip and torch)
# then name .baselines in the device call's carry (tests/run_gpu.sh step bench1 reads it there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
VERSION=${1:-${FLASHINFER_VERSION:-$($PY -c 'from moe_ar_tools.baselines import flashinfer_norm as f; print(f.PINNED_VERSION)')}}
DEST=.baselines/flashinfer
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the pure-Python wheel (no platform tags to match); its dependencies are not needed and not fetched
$PY -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==$VERSION"
mkdir -p "$DEST"
$PY -m moe_ar_tools.baselines.flashinfer_norm extract "$tmp"/flashinfer_python-*.whl "$DEST"
if $PY -c 'import sys; from moe_ar_tools.baselines import flashinfer_norm as f; sys.exit(f.find_nvcc() is None)'; then
    echo "prebuilding the library with nvcc (a minute or two on 2 cores) ..."
    $PY -m moe_ar_tools.baselines.flashinfer_norm build "$DEST" \
        || echo "prebuild failed: the GPU machine builds the library itself"
else
    echo "no nvcc here: the GPU machine builds the library itself"
fi
du -sh "$DEST"
echo "done: carry .baselines on the device call"
