#!/usr/bin/env bash
# The cluster layout of one vector a thread and the one-order sum of squares (this tree) against the
# tree before them (OLD, a `git archive` of it), arms interleaved A/B/A/B, each the world-size-1 bench
# in its own process (every output of ours checked against the float64 reference before it is timed).
#   OLD=/path/to/old/tree [SHAPES=H:K[:shared]] bash experiments/world_size_1/cluster_one_vector/ab.sh OUT [TOKENS] [BUDGET]
set -uo pipefail
out=$1; tokens=${2:-1,16,32,48,64,128,1024,8192}; budget=${3:-60}; shapes=${SHAPES:-7168:8:shared}
new=$(pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
for arm in old new oldb newb; do
    tree=$new; [[ $arm == old* ]] && tree=$OLD
    t0=$SECONDS
    (cd "$tree" && PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) python3 -m moe_ar_tools.bench --world 1 \
        --shapes "$shapes" --tokens "$tokens" --profiles plain,fp8_group128_row,fp8_tensor,nvfp4 \
        --systems ours --compile-modes dynamic --no-programs --budget-s "$budget" --out "$out/$arm" \
        > "$out/$arm.log" 2>&1)
    echo "$arm: rc $? $((SECONDS - t0)) s"
done
