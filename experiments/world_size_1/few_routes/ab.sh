#!/usr/bin/env bash
# The streaming program's few-routes builds (this tree: top_k <= 2 at H <= 4096 run 2 vectors a thread
# under 64 registers) against the tree before them (OLD), arms interleaved A/B/A/B, each the world-size-1
# bench in its own process (every output of ours checked against the float64 reference before it is
# timed), one compile cache per tree; the Triton kernel in the last arm. Then the GPU tests of the builds.
#   OLD=/path/to/old/tree [SHAPES=H:K,...] [TOKENS=...] bash experiments/world_size_1/few_routes/ab.sh OUT
set -uo pipefail
out=$1; mkdir -p "$out/ab"; out=$(cd "$out" && pwd)
shapes=${SHAPES:-4096:2,2048:2}; tokens=${TOKENS:-256,512,2048,8192}
new=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
old_cache=$(mktemp -d); new_cache=$(mktemp -d)
for arm in old new oldb newb; do
    tree=$new; cache=$new_cache; [[ $arm == old* ]] && tree=$OLD && cache=$old_cache
    systems=ours; [ $arm = newb ] && systems=ours,triton_fused
    t0=$SECONDS
    (cd "$tree" && PYTHONPATH=. MOE_AR_CACHE_DIR=$cache timeout 150 python3 -m moe_ar_tools.bench --world 1 \
        --shapes "$shapes" --tokens "$tokens" --profiles plain,fp8_tensor,nvfp4 --systems $systems \
        --compile-modes dynamic --no-programs --budget-s 100 --out "$out/ab/$arm" > "$out/ab/$arm.log" 2>&1)
    echo "$arm: rc $? $((SECONDS - t0)) s" | tee -a "$out/ab/arms.txt"
    rm -f "$out/ab/$arm/records.json" "$out/ab/$arm/latency.png"
done
python3 experiments/world_size_1/small_rows_cluster/table.py "$out/ab" old new oldb newb | tee "$out/ab_table.md"
tar -czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab"
PYTHONPATH=. MOE_AR_CACHE_DIR=$new_cache timeout ${TEST_S:-240} python3 -m pytest -q -m gpu tests/test_gpu_world_one.py \
    -k "test_streaming_builds_give_the_programs_bits or test_a_tokens_outputs_are_the_same_bits" -p no:cacheprovider \
    2>&1 | tee "$out/pytest.txt" | tail -5
