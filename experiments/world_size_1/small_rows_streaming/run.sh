#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's tree was carried: the streaming
# program at H <= 4096 with more blocks a multiprocessor. Arms NAME:CAP:VEC:ANY_TOP_K (ARMS, default
# below; empty field = committed): "base" the committed program (register bound 128, 4 vectors a
# thread, builds for top_k 8 only: 4 blocks of 4 warps a multiprocessor at H 4096); "anyk" builds
# for every top_k; "c96" bound 96 (5 blocks); "v2c64" 2 vectors a thread under bound 64 (4 blocks of
# 8 warps). H 4096 top_k 2 and 8, H 2048 top_k 8, 512-8,192 tokens, ours without PDL; TRITON=1 adds
# the Triton kernel to the last arm; SHAPES the bench's --shapes (default the three above).
#   [ARMS="..."] [TRITON=1] [SHAPES=...] bash experiments/world_size_1/small_rows_streaming/run.sh OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=$1; tree=.baselines/small_rows_streaming; mkdir -p "$out/ab"; out=$(cd "$out" && pwd)
export MOE_AR_CACHE_DIR=${MOE_AR_CACHE_DIR:-$(mktemp -d)}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
set -- ${ARMS:-base::: anyk:::1 c96:96::1 v2c64:64:2:1}
last=${!#}
for arm in "$@"; do
    IFS=: read -r name cap vec anyk <<< "$arm"
    systems=ours; [ "${TRITON:-0}" = 1 ] && [ "$arm" = "$last" ] && systems=ours,triton_fused
    (cd "$tree" && MOE_AR_PROBE_STREAM_CAP=$cap MOE_AR_PROBE_STREAM_VEC=$vec MOE_AR_PROBE_STREAM_ANY_TOP_K=$anyk \
        PYTHONPATH=. timeout 140 python3 -m moe_ar_tools.bench --world 1 --shapes ${SHAPES:-4096:2,4096:8,2048:8} \
        --tokens 512,2048,8192 --profiles plain,fp8_tensor,nvfp4 --systems $systems --compile-modes dynamic \
        --no-programs --budget-s 120 --out "$out/ab/$name" > "$out/ab/$name.log" 2>&1)
    echo "$name: rc $?"; rm -f "$out/ab/$name/records.json" "$out/ab/$name/latency.png"
done
python3 experiments/world_size_1/small_rows_cluster/table.py "$out/ab" $(for a in "$@"; do echo "${a%%:*}"; done) \
    | tee "$out/ab_table.md"
tar -czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab"
