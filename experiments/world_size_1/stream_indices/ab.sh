#!/usr/bin/env bash
# Trees against each other, arms interleaved (each tree twice, in the order given), each arm the
# world-size-1 bench in its own process (every output of ours checked against the float64 reference
# before it is timed). TREES: space-separated name=path pairs.
#   TREES="old=/path/a new=/path/b" [SHAPES=H:K[:shared],...] [PROFILES=p,...] [SYSTEMS=ours,ours_pdl] bash experiments/world_size_1/stream_indices/ab.sh OUT [TOKENS] [BUDGET]
set -uo pipefail
out=$1; tokens=${2:-256,1024,2048,8192}; budget=${3:-90}; shapes=${SHAPES:-7168:8:shared}
profiles=${PROFILES:-plain,fp8_group128_row,fp8_tensor,nvfp4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
for pass in "" b; do
    for pair in $TREES; do
        name=${pair%%=*}$pass; tree=${pair#*=}
        t0=$SECONDS
        (cd "$tree" && PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) python3 -m moe_ar_tools.bench --world 1 \
            --shapes "$shapes" --tokens "$tokens" --profiles "$profiles" \
            --systems "${SYSTEMS:-ours}" --compile-modes dynamic --no-programs --budget-s "$budget" --out "$out/$name" \
            > "$out/$name.log" 2>&1)
        echo "$name: rc $? $((SECONDS - t0)) s"
    done
done
