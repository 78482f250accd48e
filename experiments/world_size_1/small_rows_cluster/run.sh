#!/usr/bin/env bash
# On the GPU machine, from the repository root (the change's commit), with the parent's tree carried
# as .baselines/base (git archive PARENT | tar -x -C .baselines/base): the latency program's cluster
# layout at rows of 4 to 11 warps ("new") against the one-block layout ("base"), H 4096 top_k 8 and 2,
# H 2048 top_k 8, H 5120 top_k 1 + shared, 1-48 tokens, every profile, ours without PDL; "new" beside
# the Triton kernel in the same run; then the world-size-1 GPU tests at the change.
#   bash experiments/world_size_1/small_rows_cluster/run.sh OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=$1; mkdir -p "$out/ab"; out=$(cd "$out" && pwd); root=$(pwd)
export MOE_AR_CACHE_DIR=$(mktemp -d)  # one compile cache: the two trees' kernels are the same source
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bench() {  # bench NAME TREE SYSTEMS BUDGET
    (cd "$2" && PYTHONPATH=. timeout $(( $4 + 20 )) python3 -m moe_ar_tools.bench \
        --world 1 --shapes 4096:8,4096:2,2048:8,5120:1:shared --tokens 1,16,32,48 \
        --profiles plain,fp8_group128_row,nvfp4,fp8_tensor --systems "$3" --compile-modes dynamic \
        --no-programs --budget-s "$4" --out "$out/ab/$1" > "$out/ab/$1.log" 2>&1)
    echo "$1: rc $?"; rm -f "$out/ab/$1/records.json" "$out/ab/$1/latency.png"
}
bench base .baselines/base ours 100
bench new "$root" ours,triton_fused 140
python3 experiments/world_size_1/small_rows_cluster/table.py "$out/ab" base new | tee "$out/ab_table.md"
tar -czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab"
STEPS=tests TESTS_TIMEOUT=${TESTS_TIMEOUT:-270} COMMIT=${MOE_AR_COMMIT:-unknown} OUT=$out/tests \
    bash tests/run_gpu.sh -k test_gpu_world_one 2>&1 | tail -n 8
