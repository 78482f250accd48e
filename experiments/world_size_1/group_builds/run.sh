#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's trees were carried: the A/B of FP8
# group-128's streaming build (off, on, off, on; plain as the control, its programs the same in both)
# at five hidden sizes, then the `on` tree against the Triton kernel at the smaller shapes.
#   bash experiments/world_size_1/group_builds/run.sh OUT
set -uo pipefail
out=$1; here=$(dirname "$0"); ab=$(mktemp -d)
TREES="off=.baselines/group_off on=.baselines/group_on" SHAPES=7168:8:shared,6144:8,5120:8,4096:8,2048:8 \
    PROFILES=fp8_group128_row,plain timeout 420 bash "$here/../stream_indices/ab.sh" "$ab" 256,512,1024,2048,8192 40
python3 "$here/../stream_prefetch/table.py" "$ab" off,on > "$out/ab_table.md"
cat "$out/ab_table.md"
(cd .baselines/group_on && PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) timeout 120 python3 -m moe_ar_tools.bench \
    --world 1 --shapes 4096:8,2048:8 --tokens 512,2048,8192 --profiles fp8_group128_row \
    --systems ours,triton_fused --compile-modes dynamic --no-programs --budget-s 80 --out "$ab/triton" \
    > "$ab/triton.log" 2>&1)
cp "$ab/triton/table.md" "$out/triton_table.md" && cat "$out/triton_table.md"
tail -n 3 "$ab"/*.log
