#!/usr/bin/env bash
# Where the latency program should hand over to the streaming program at few routes (top_k 1-2): the
# world-size-1 bench with every program of a cell forced (--programs) beside the automatic choice and
# the Triton kernel, cold and warm L2, then the few-routes builds' GPU tests on this machine.
#   [SHAPES=H:K,...] [TOKENS=...] [PROFILES=...] [BUDGET_S=...] bash experiments/world_size_1/top_k_handover/run.sh OUT
set -uo pipefail
out=$1; mkdir -p "$out"; out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$out/gpu.txt"
export MOE_AR_CACHE_DIR=$(mktemp -d)
t0=$SECONDS
PYTHONPATH=. timeout $((${BUDGET_S:-300} + 60)) python3 -m moe_ar_tools.bench --world 1 \
    --shapes "${SHAPES:-4096:2,2048:2}" --tokens "${TOKENS:-128,256,384,512,768,1024,2048}" \
    --profiles "${PROFILES:-plain,fp8_tensor,nvfp4}" --systems ours,triton_fused --compile-modes dynamic \
    --budget-s "${BUDGET_S:-300}" --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench: rc $? $((SECONDS - t0)) s" | tee -a "$out/arms.txt"
rm -f "$out/bench/records.json"
[ "${TEST_S:-0}" -gt 0 ] && PYTHONPATH=. timeout "$TEST_S" python3 -m pytest -q -m gpu tests/test_gpu_world_one.py \
    -k "test_streaming_builds_give_the_programs_bits or test_a_tokens_outputs_are_the_same_bits" -p no:cacheprovider \
    2>&1 | tee "$out/pytest.txt" | tail -5
exit 0
