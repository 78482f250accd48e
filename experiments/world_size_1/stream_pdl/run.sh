#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's trees were carried: the A/B of where
# the streaming layout lets the next kernel launch (v0, v1, v2 interleaved, each twice), each arm
# timed without and with PDL.
#   bash experiments/world_size_1/stream_pdl/run.sh OUT
set -uo pipefail
out=$1; here=$(dirname "$0"); ab=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
TREES="v0=.baselines/pdl_v0 v1=.baselines/pdl_v1 v2=.baselines/pdl_v2" SYSTEMS=ours,ours_pdl \
    SHAPES=7168:8:shared,4096:8 PROFILES=plain,fp8_group128_row \
    timeout 500 bash "$here/../stream_indices/ab.sh" "$ab" 128,192,256,320,512,1024,2048 50
python3 "$here/table.py" "$ab" v0,v1,v2 > "$out/ab_table.md"
cat "$out/ab_table.md"
tar -czf "$out/summaries.tgz" -C "$ab" $(cd "$ab" && ls -d v*/summary.json 2>/dev/null)
tail -n 3 "$ab"/*.log
