#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's tree was carried: the latency
# program's row over one vector a thread (MOE_AR_PROBE_ONE_VECTOR=1, "one") against two (the
# committed split, "two") at H 4096 top_k 8, H 2048 top_k 8 and H 4096 top_k 2, 1-512 tokens,
# interleaved, each twice (ours without PDL), then "one" beside the Triton kernel.
#   bash experiments/world_size_1/small_rows_one_vector/run.sh OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=$1; tree=.baselines/one_vector; mkdir -p "$out/ab"; out=$(cd "$out" && pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bench() {  # bench NAME ONE_VECTOR SYSTEMS BUDGET
    (cd "$tree" && MOE_AR_PROBE_ONE_VECTOR=$2 PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) timeout 150 python3 -m moe_ar_tools.bench \
        --world 1 --shapes 4096:8,2048:8,4096:2 --tokens 1,32,128,512 --profiles plain,fp8_group128_row,nvfp4 \
        --systems "$3" --compile-modes dynamic --no-programs --budget-s "$4" --out "$out/ab/$1" > "$out/ab/$1.log" 2>&1)
    echo "$1: rc $?"; rm -f "$out/ab/$1/records.json" "$out/ab/$1/latency.png"
}
for pass in "" b; do bench two$pass 0 ours 70; bench one$pass 1 ours 70; done
python3 experiments/world_size_1/stream_next_idx/table.py "$out/ab" two,one | tee "$out/ab_table.md"
bench triton 1 ours,triton_fused 90; tail -n 24 "$out/ab/triton.log"
tar -czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab"
