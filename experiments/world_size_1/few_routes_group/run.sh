#!/usr/bin/env bash
# FP8 group-128's few-routes build (this tree) against the tree before it (.baselines/fg_old), the
# latency program's shape builds to 1,024 tokens (.baselines/fg_lat) and the sums of squares with a
# barrier and the zero butterfly steps fewer (.baselines/fg_bs, ../sum_barriers/): each arm the world-size-1 bench
# in its own process with every program of a cell forced beside the automatic choice (every output of
# ours checked against the float64 reference before it is timed), one compile cache a tree, cold and
# warm L2; the Triton kernel in the `new` arm. GPU tests of the builds first. Not in the default
# ARMS: base7/lean7/base7b/lean7b, the streaming program with lean_stream_sum.patch (.baselines/fg_lean,
# arms.sh LEAN=1) against this tree at H 7168 + shared, 6144 and 4096 top_k 8, A/B/A/B.
#   [TEST_S=...] [BENCH_S=100] [ARMS="new old ..."] bash experiments/world_size_1/few_routes_group/run.sh OUT
set -uo pipefail
out=$1; mkdir -p "$out"; out=$(cd "$out" && pwd)
new=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
new_cache=$(mktemp -d)
[ "${TEST_S:-150}" -gt 0 ] && PYTHONPATH=. MOE_AR_CACHE_DIR=$new_cache timeout "${TEST_S:-150}" python3 -m pytest -q -m gpu tests/test_gpu_world_one.py \
    -k "(streaming_builds or same_bits or selection_is_local) and fp8_group128" \
    -p no:cacheprovider 2>&1 | tee "$out/pytest.txt" | tail -3
few="4096:2,2048:2,1024:2,2048:1"; fewT=192,320,512,1024,4096
eight="2048:8,1024:8"; eightT=384,512,768
both=plain,fp8_group128_row
big="7168:8:shared,6144:8,4096:8"; bigT=2048,8192  # the lean arms (ARMS="base7 lean7 base7b lean7b")
b=$new/.baselines
for arm in "new|$new|$few|$fewT|$both|ours,triton_fused" "old|$b/fg_old|$few|$fewT|fp8_group128_row|ours" \
           "bs|$b/fg_bs|$few|$fewT|$both|ours" \
           "newb|$new|$eight|$eightT|$both|ours,triton_fused" "lat|$b/fg_lat|$eight|$eightT|$both|ours" \
           "bsb|$b/fg_bs|$eight|$eightT|$both|ours" \
           "base7|$new|$big|$bigT|plain,nvfp4|ours" "lean7|$b/fg_lean|$big|$bigT|plain,nvfp4|ours" \
           "base7b|$new|$big|$bigT|plain,nvfp4|ours,triton_fused" "lean7b|$b/fg_lean|$big|$bigT|plain,nvfp4|ours"; do
    IFS='|' read -r name tree shapes tokens profiles systems <<< "$arm"
    [ -d "$tree" ] && [[ " ${ARMS:-new old bs newb lat bsb} " == *" $name "* ]] || continue
    t0=$SECONDS
    (cd "$tree" && PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) timeout 140 python3 -m moe_ar_tools.bench --world 1 \
        --shapes "$shapes" --tokens "$tokens" --profiles "$profiles" --systems "$systems" \
        --compile-modes dynamic --budget-s "${BENCH_S:-100}" --out "$out/$name" > "$out/$name.log" 2>&1)
    echo "$name: rc $? $((SECONDS - t0)) s" | tee -a "$out/arms.txt"
    rm -f "$out/$name/records.json" "$out/$name/latency.png"
done
arms=$(cd "$out" && ls -d new old bs newb lat bsb base7 lean7 base7b lean7b 2>/dev/null)
tar -czf "$out/arms.tgz" -C "$out" $arms && (cd "$out" && rm -rf $arms)
