#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's trees were carried: the A/B of the
# streaming layout's L2 bulk prefetches (v0..v3 interleaved, each twice), then v0 and v3 each against
# the Triton kernel in a bench process of its own.
#   bash experiments/world_size_1/stream_l2_bulk/run.sh OUT
set -uo pipefail
out=$1; here=$(dirname "$0"); ab=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
TREES="v0=.baselines/l2bulk_v0 v1=.baselines/l2bulk_v1 v2=.baselines/l2bulk_v2 v3=.baselines/l2bulk_v3" \
    SHAPES=7168:8:shared,4096:8 timeout 400 bash "$here/../stream_indices/ab.sh" "$ab" 256,512,1024,2048,8192 34
python3 "$here/../stream_prefetch/table.py" "$ab" v0,v1,v2,v3 > "$out/ab_table.md"
cat "$out/ab_table.md"
for arm in v0 v3; do
    (cd .baselines/l2bulk_$arm && PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) timeout 62 python3 -m moe_ar_tools.bench \
        --world 1 --shapes 7168:8:shared --tokens 1024,2048,8192 --profiles plain \
        --systems ours,triton_fused --compile-modes dynamic --no-programs --budget-s 45 --out "$ab/triton_$arm" \
        > "$ab/triton_$arm.log" 2>&1)
    cp "$ab/triton_$arm/table.md" "$out/triton_$arm.md" && cat "$out/triton_$arm.md"
done
tar -czf "$out/summaries.tgz" -C "$ab" $(cd "$ab" && ls -d v*/summary.json triton_*/summary.json 2>/dev/null)
tail -n 3 "$ab"/*.log
