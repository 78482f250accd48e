#!/usr/bin/env bash
# On the GPU machine, from the repository root: the change as committed (`new`, this checkout's
# programs) against the programs before it (`old`), each timed without and with PDL (old, new, old,
# new), then the world-size-1 GPU tests of this checkout. The trees, built on this machine:
#   mkdir -p .baselines/pdl_old .baselines/pdl_new && git archive BEFORE | tar -x -C .baselines/pdl_old
#   git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C .baselines/pdl_new
#   bash experiments/world_size_1/stream_pdl/confirm.sh OUT
set -uo pipefail
out=$1; here=$(dirname "$0"); ab=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
TREES="old=.baselines/pdl_old new=.baselines/pdl_new" SYSTEMS=ours,ours_pdl SHAPES=7168:8:shared,4096:8 \
    PROFILES=plain,fp8_group128_row timeout 240 bash "$here/../stream_indices/ab.sh" "$ab" \
    128,192,256,320,512,1024,2048,8192 40
python3 "$here/table.py" "$ab" old,new > "$out/confirm_table.md"
cat "$out/confirm_table.md"
tar -czf "$out/confirm_summaries.tgz" -C "$ab" $(cd "$ab" && ls -d */summary.json 2>/dev/null)
export PYTHONPATH=. PYTHONUNBUFFERED=1 MOE_AR_CACHE_DIR=$(mktemp -d)
MOE_AR_RESULTS="$out/gpu-tests.jsonl" timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
    tests/test_gpu_world_one.py 2>&1 | tee "$out/gpu-tests.txt" | tail -8
