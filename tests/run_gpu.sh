#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call, results under $OUT (default ./gpu-out):
#   1. the GPU tests (every program, emulated 2/4/8 on one and on two GPUs, two real processes,
#      faults, the torch custom op), one JSON line per test in $OUT/gpu-tests.jsonl;
#   2. the benchmark against NCCL and torch symmetric memory (2 GPUs), JSON + PNG + summary;
#   3. the two-process example, plain and NVFP4.
# Usage on the device machine: bash tests/run_gpu.sh [pytest-args...]
# Set STEPS="tests bench example" (default) to choose steps; COMMIT to record the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast can take a shared host's GPUs down: keep it off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MOE_AR_CACHE_DIR=${MOE_AR_CACHE_DIR:-/tmp/moe_ar_cache}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export MOE_AR_COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
STEPS=${STEPS:-tests bench example}
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"

if [[ " $STEPS " == *" tests "* ]]; then
    MOE_AR_RESULTS="$OUT/gpu-tests.jsonl" timeout 480 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -5 || status=1
fi
if [[ " $STEPS " == *" bench "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 420 python3 -m dispatch.bench --cold-start --time-budget-s 300 --out "$OUT/bench.json" 2>&1 \
        | grep -v "it/s]" | tail -40 || status=1
fi
if [[ " $STEPS " == *" example "* ]] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    for q in none nvfp4; do
        timeout 180 torchrun --nproc-per-node 2 -m dispatch.example_moe_tail --quant "$q" 2>&1 \
            | tail -8 | tee -a "$OUT/example.log" || status=1
    done
fi
exit $status
