#!/usr/bin/env bash
# One device call (about 500 s on one H200): world size 1's tables refitted to the programs
# (`gen-programs tune`, through tests/run_gpu.sh's tune step); then, under the refitted set as the
# user's tables ($MOE_AR_TABLES: the selection the set gets once committed), the headline bench of
# bench_results/world_size_1/README.md, and the streaming row in the Triton kernel's order at
# one-wave token counts (../stream_natural_order/ab_natural.py). FlashInfer's norm kernels come from
# .baselines (moe_ar_tools/baselines/fetch_flashinfer.sh here, then carry .baselines).
# Results under $OUT (7 files): tune.json, tune.log, bench1/{summary.json,records.json,table.md,
# latency.png}, probes.tgz (gpu.txt, bench1.log, nat/).
#   bash experiments/world_size_1/h200_refit/call1.sh
# Afterwards, here: tune.json and tune.log become bench_results/tuning/h200-ws1-<date>-<what>.{json,log},
# named in generator/table_sets.py COMMITTED_SETS and pyproject.toml's package data in place of the
# world-size-1 file; then gen-programs, gen-programs diff HEAD, and bench1/ into bench_results/world_size_1/.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOE_AR_CACHE_DIR=${MOE_AR_CACHE_DIR:-/tmp/moe-ar-cache}  # kept for the next call on a warm machine
O=${OUT:-gpu-out}; P=/tmp/probes; mkdir -p "$O" $P/nat
pack() { tar czf "$O/probes.tgz" -C $P .; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee $P/gpu.txt
T=1,2,4,8,16,32,64,128,136,144,192,256,320,384,512,640,768,1024,2048,4096,8192,16384
STEPS=tune TUNE_BUDGET=${TUNE_BUDGET:-200} TUNE_TIMEOUT=260 \
    TUNE_ARGS="--world-sizes 1 --shapes 7168:8:shared,4096:8,2048:8 --tokens $T" bash tests/run_gpu.sh
rm -f "$O/results.tgz" "$O/gpus.txt"  # tune.json and tune.log are in $O directly
export PYTHONPATH=. MOE_AR_COMMIT="${MOE_AR_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) + the tables of tune.json}"
# under the refitted set where it is the committed set's machine (an H200) and the tune completed, else
# the committed tables (a missing or partial set would otherwise cost the headline too)
complete=$(python3 -c "import json; print(json.load(open('$O/tune.json')).get('complete'))" 2>/dev/null)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)/$complete" in
    *H200*/True) export MOE_AR_TABLES=$O/tune.json ;;
    *) echo "headline under the committed tables (tune complete: ${complete:-no file})" ;;
esac
timeout 260 python3 -m moe_ar_tools.bench --world 1 --shapes 7168:8:shared --tokens 1,16,32,128,256,1024,2048,8192 \
    --profiles plain,fp8_group128_row,nvfp4,fp8_tensor --systems ours,ours_pdl,triton_fused,chain,torch_compile,flashinfer \
    --compile-modes dynamic --no-programs --budget-s "${BENCH_BUDGET:-220}" --out "$O/bench1" > $P/bench1.log 2>&1
tail -22 $P/bench1.log | cut -c1-220
PYTHONPATH=.:experiments/world_size_1/stream_natural_order NAT_BUDGET=${NAT_BUDGET:-40} timeout 200 \
    python3 experiments/world_size_1/stream_natural_order/ab_natural.py $P/nat 128,192,256,384,512 2>&1 | tail -6
