#!/usr/bin/env bash
# Where no H200 comes, one H100 call (about 540 s): the bench's smaller shapes against the Triton
# kernel at the committed programs (H 4096 top_k 2 and 8, H 2048 top_k 8, every output profile, both
# L2 modes), then `gen-programs tune` of world size 1 on this H100 (does the H200 set, which an H100
# takes at world size 1, choose as this machine's own fit would?). Results under $OUT: gpu.txt,
# shapes/ (summary.json, table.md, latency.png), shapes.log, tune.json, tune.log.
#   bash experiments/world_size_1/h200_refit/call_h100.sh
set -uo pipefail
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=.
export MOE_AR_CACHE_DIR=${MOE_AR_CACHE_DIR:-/tmp/moe-ar-cache}
O=${OUT:-gpu-out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$O/gpu.txt"
timeout 330 python3 -m moe_ar_tools.bench --world 1 --shapes 4096:2,4096:8,2048:8 \
    --tokens 1,32,128,256,512,1024,2048,8192 --profiles plain,fp8_tensor,fp8_group128_row,nvfp4 \
    --systems ours,triton_fused --compile-modes dynamic --no-programs --budget-s "${SHAPES_BUDGET:-270}" \
    --out "$O/shapes" > "$O/shapes.log" 2>&1
tail -40 "$O/shapes.log"
rm -f "$O/shapes/records.json"
T=1,2,4,8,16,32,64,128,136,144,192,256,320,384,512,640,768,1024,2048,4096,8192,16384
STEPS=tune TUNE_BUDGET=${TUNE_BUDGET:-170} TUNE_TIMEOUT=200 \
    TUNE_ARGS="--world-sizes 1 --shapes 7168:8:shared,4096:8,2048:8 --tokens $T" bash tests/run_gpu.sh
rm -f "$O/results.tgz" "$O/gpus.txt"
