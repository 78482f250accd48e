#!/usr/bin/env bash
# On the GPU machine, from the repository root, after arms.sh's trees were carried: v0 against v1,
# interleaved, each twice (ours without PDL; H 4096 top_k 2 and H 7168 top_k 8 + shared), then v1
# beside the Triton kernel at H 4096 top_k 2.
#   bash experiments/world_size_1/stream_next_idx/run.sh OUT
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=$1; here=$(dirname "$0"); ab=$out/ab; mkdir -p "$ab"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
TREES="v0=.baselines/nx_v0 v1=.baselines/nx_v1" SHAPES=4096:2,7168:8:shared PROFILES=plain,nvfp4,fp8_tensor \
    timeout 290 bash "$here/../stream_indices/ab.sh" "$ab" 512,2048,8192 50
python3 "$here/table.py" "$ab" v0,v1 > "$out/ab_table.md"
cat "$out/ab_table.md"
rm -f "$ab"/*/records.json "$ab"/*/latency.png
(cd .baselines/nx_v1 && PYTHONPATH=. MOE_AR_CACHE_DIR=$(mktemp -d) timeout 80 python3 -m moe_ar_tools.bench --world 1 \
    --shapes 4096:2 --tokens 512,2048,8192 --profiles plain,fp8_tensor --systems ours,triton_fused \
    --compile-modes dynamic --no-programs --budget-s 45 --out "$ab/triton" > "$ab/triton.log" 2>&1)
tail -n 14 "$ab/triton.log"
