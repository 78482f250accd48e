#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's tree was carried: where the cluster
# layout stops paying at rows under 12 warps. "off" (limit 0: the one-block layout at every T) against
# "on" (limit 32), H 4096 top_k 8 and 2, H 2048 top_k 8, H 5120 top_k 1 + shared, 1-32 tokens, every
# profile, off/on/off/on (ours without PDL); committed: 32 at top_k 8, 16 below. SHAPES and BUDGET (s an arm)
# narrow a rerun: run 1's 110 s reached only H 4096 (bench_results/world_size_1/small_rows_limit/).
#   [SHAPES=2048:8,5120:1:shared] [BUDGET=110] bash experiments/world_size_1/small_rows_limit/run.sh OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=$1; tree=.baselines/small_rows_limit; mkdir -p "$out/ab"; out=$(cd "$out" && pwd)
export MOE_AR_CACHE_DIR=$(mktemp -d)  # one compile cache: the arms differ only in Python
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bench() {  # bench NAME LIMIT BUDGET
    (cd "$tree" && MOE_AR_PROBE_SMALL_ROW_MAX_TOKENS=$2 PYTHONPATH=. timeout $(( $3 + 20 )) python3 -m moe_ar_tools.bench \
        --world 1 --shapes "${SHAPES:-4096:2,4096:8,2048:8,5120:1:shared}" --tokens 1,2,4,8,12,16,24,32 \
        --profiles plain,nvfp4,fp8_group128_row,fp8_tensor --systems ours --compile-modes dynamic \
        --no-programs --budget-s "$3" --out "$out/ab/$1" > "$out/ab/$1.log" 2>&1)
    echo "$1: rc $?"; rm -f "$out/ab/$1/records.json" "$out/ab/$1/latency.png"
}
b=${BUDGET:-110}
for pass in "" b; do bench off$pass 0 $b; bench on$pass 32 $b; done
python3 experiments/world_size_1/stream_next_idx/table.py "$out/ab" off,on | tee "$out/ab_table.md"
tar -czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab"
