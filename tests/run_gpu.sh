#!/usr/bin/env bash
# Everything that needs the GPU machine, results under $OUT (default ./gpu-out). Steps (STEPS=...,
# default all, in this order; each has its own time limit so that a slow one cannot eat the rest):
#   tests     the GPU tests (every program, emulated 2/4/8 on one and on two GPUs, two real
#             processes, faults, reliability, FP8 consumer, the torch custom op), one JSON line per
#             test in $OUT/gpu-tests.jsonl, the log in $OUT/gpu-tests.log
#   bench     the benchmark (moe_ar_tools.bench, world size 2) against NCCL and torch symmetric memory
#             (2 GPUs), every output profile: JSON + PNG + summary; the table sets are fitted to the
#             files generator/table_sets.py COMMITTED_SETS names
#   fp8bench  FP8 profiles against plain and against plain + a separate quantization kernel
#   autobench the automatic choice under the committed tables against every forced program
#   latency   small-T latency: default, with PDL, and with each fixed row split (vec_per_thread 4, 2)
#   soak      long randomized runs (moe_ar_tools/soak/): world size 2 on two GPUs, 4 and 8 emulated
#             on one GPU each; moe_ar_tools/reliability_summary.py turns the results into the summary
#   hosttime  host time of one rank's eager call (checks, launch) beside torch.add (moe_ar_tools.host_time)
#   backend   the CUDA IPC and symmetric-memory workspaces side by side (moe_ar_tools.backend_cost)
#   example   the two-process examples: moe_tail.py plain and NVFP4, minimal.py
#   bench1    the same benchmark at world size 1 on one GPU (--world 1): ours against the Triton kernels,
#             the eager and compiled torch chains and FlashInfer's norm kernels, into $OUT/bench1/ directly (summary.json,
#             records.json, table.md, latency.png) and $OUT/bench1.log; FlashInfer's kernels come from
#             .baselines/ (moe_ar_tools/baselines/fetch_flashinfer.sh here, then carry .baselines)
#   tune      `gen-programs tune` of this machine (world size 1, and 2 and up where as many GPUs are
#             here: one process a GPU), into $OUT/tune.json and $OUT/tune.log; a call killed at the
#             device's limit leaves the units done (rerun with the file to resume)
# Usage on the device machine: bash tests/run_gpu.sh [pytest-args...]; COMMIT records the commit.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast can take a shared host's GPUs down: keep it off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# A fresh private compile cache (a fixed /tmp path could be made first by another user; then refused).
export MOE_AR_CACHE_DIR=${MOE_AR_CACHE_DIR:-$(mktemp -d -t moe-ar-cache-XXXXXX)}
# Results gather in $RES and are packed into $OUT/results.tgz after every step (the device tool
# brings back at most 8 files); the tests' log and JSON lines go to $OUT directly.
FINAL_OUT=${OUT:-gpu-out}; mkdir -p "$FINAL_OUT"
OUT=${RES:-$(mktemp -d /tmp/moe-ar-gpu-XXXX)}; mkdir -p "$OUT"
pack() { tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . 2>/dev/null; true; }
trap pack EXIT
export MOE_AR_COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
STEPS=${STEPS:-tests bench fp8bench autobench latency soak hosttime backend example bench1 tune}
GPUS=$(nvidia-smi -L | wc -l)
status=0
step() { pack; [[ " $STEPS " == *" $1 "* ]]; }  # packs what the steps before wrote
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"

# Fill the compile cache for this GPU's target with every program, in parallel, before anything runs
# (first use would otherwise compile them one at a time inside the tests).
python3 - <<'PY' || status=1
import concurrent.futures as cf, os, subprocess, time
from dispatch import registry  # no CUDA context here: the workers only run NVRTC
cc = subprocess.check_output(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], text=True)
target = registry.TARGET_FOR_CAPABILITY[tuple(int(x) for x in cc.split()[0].split("."))]
t0 = time.perf_counter()
with cf.ProcessPoolExecutor(os.cpu_count()) as pool:
    list(pool.map(registry.cached_cubin, registry.programs(), [target] * len(registry.programs())))
print(f"compile cache: {len(registry.programs())} programs for {target} in {time.perf_counter() - t0:.1f} s")
PY

if step tests; then
    # straight into the final folder: these survive even a run killed at the device's time limit
    MOE_AR_RESULTS="$FINAL_OUT/gpu-tests.jsonl" timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -m gpu -q \
        -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" --durations=15 tests "$@" 2>&1 \
        | tee "$FINAL_OUT/gpu-tests.log" | tail -30 || status=1
fi
BENCH="timeout 300 python3 -m moe_ar_tools.bench"
if step bench && [ "$GPUS" -ge 2 ]; then
    # every profile, so that each profile's cells get boundaries fitted to their own programs
    # (a profile not measured borrows the plain profile's); about 300 s on 2x H200
    timeout 580 python3 -m moe_ar_tools.bench --cold-start --profiles plain,nvfp4,fp8_group128,fp8_tensor \
        --budget-s "${BENCH_BUDGET:-420}" --out "$OUT/bench.json" 2>&1 | grep -v "it/s]" | tail -40 || status=1
fi
if step fp8bench && [ "$GPUS" -ge 2 ]; then
    $BENCH --shapes 7168:8:shared --tokens 1,16,128,256,1024,4096,8192 --profiles plain,fp8_group128,fp8_tensor \
        --systems auto,auto+quant --out "$OUT/bench-fp8.json" 2>&1 | grep -v "it/s]" | tail -30 || status=1
fi
if step autobench && [ "$GPUS" -ge 2 ]; then
    # the automatic choice under the committed tables against every forced program, target shape
    # (not a tuning input: only the files of generator/table_sets.py COMMITTED_SETS are; this goes to bench_results/auto/)
    $BENCH --shapes 7168:8:shared --profiles plain,nvfp4 --systems auto,programs --bw-gib 1 \
        --out "$OUT/bench-auto.json" 2>&1 | grep -v "it/s]" | tail -35 || status=1
fi
if step latency && [ "$GPUS" -ge 2 ]; then
    # the default (row split per call), with PDL, and each fixed split: where the per-call boundary belongs
    for variant in "" "--pdl" "--vec-per-thread 4" "--vec-per-thread 2"; do
        tag=$(echo "default $variant" | tr -d ' -')
        $BENCH --shapes 7168:8:shared --tokens 1,16,64,128,256,512,1024 --profiles plain --systems auto,nccl+torch \
            --bw-gib 1 $variant --out "$OUT/bench-latency-$tag.json" 2>&1 | grep -v "it/s]" | tail -10 || status=1
    done
fi
if step soak; then
    # ws4 and ws8 emulated side by side, one per GPU, then ws2 over both GPUs; no call starts after
    # SOAK_BUDGET_S (the JSON then says how many calls it made and why it stopped)
    CALLS=${SOAK_CALLS:-100000} BUDGET=${SOAK_BUDGET_S:-200}
    soak() {  # soak NAME CUDA_VISIBLE_DEVICES ARGS...
        local name=$1 vis=$2; shift 2
        CUDA_VISIBLE_DEVICES=$vis timeout $((BUDGET + 120)) python3 -m moe_ar_tools.soak --calls "$CALLS" \
            --time-budget-s "$BUDGET" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
        local rc=$?; echo "$name: exit $rc; $(tail -1 "$OUT/$name.log")"; return $rc
    }
    if [ "$GPUS" -ge 2 ]; then
        soak soak-ws4 0 --world-size 4 & p4=$!
        soak soak-ws8 1 --world-size 8 || status=1
        wait $p4 || status=1
        soak soak-ws2 0,1 --world-size 2 --devices 0,1 || status=1
    else
        for W in 4 8 2; do soak soak-ws$W 0 --world-size $W || status=1; done
    fi
fi
if step hosttime; then
    # host time of one rank's eager call, split into its parts, beside torch.add (one GPU is enough)
    timeout 240 python3 -m moe_ar_tools.host_time --out "$OUT/host-time.json" 2>&1 | tail -24 || status=1
fi
if step backend && [ "$GPUS" -ge 2 ]; then
    # the two workspace backends side by side: allocation, bytes per rank, call time under graph replay
    timeout 300 torchrun --nproc-per-node 2 -m moe_ar_tools.backend_cost --out "$OUT/backend-cost.json" 2>&1 \
        | tail -20 || status=1
fi
if step example && [ "$GPUS" -ge 2 ]; then
    for q in none nvfp4; do
        timeout 180 torchrun --nproc-per-node 2 examples/moe_tail.py --quant "$q" 2>&1 \
            | tail -8 | tee -a "$OUT/example.log" || status=1
    done
    timeout 180 torchrun --standalone --nproc-per-node 2 examples/minimal.py 2>&1 \
        | tail -4 | tee -a "$OUT/example.log" || status=1
fi
if step bench1; then
    # Sized for one ~9-minute device call of STEPS=bench1 alone (the compile-cache fill above first, ~15 s):
    # the target shape, every profile, 1..16,384 tokens, torch.compile dynamic and per T. Expected: start-up,
    # bandwidth, programs and the floor ~20 s (+ ~25 s where FlashInfer's library was not prebuilt); the
    # dynamic compiles (5 profiles x {T=1, T>1} + the finalize) ~50 s; the per-T compiles (15 T x 5 profiles
    # + the finalize) ~3 s each, ~270 s, the bulk and the least certain; the 75 points' timing ~110 s (up to
    # ~7 s a point at 8,192-16,384 tokens). The budget stops starting points at BENCH1_BUDGET s (skipped
    # ones listed in summary.json). The other shapes (dynamic compiles only, ~6-7 min): a second call with
    # BENCH1_SHAPES=7168:8,7168:4:shared,4096:8.
    timeout "${BENCH1_TIMEOUT:-550}" python3 -m moe_ar_tools.bench --world 1 --shapes "${BENCH1_SHAPES:-7168:8:shared}" \
        --tokens "${BENCH1_TOKENS:-1-16384}" --profiles "${BENCH1_PROFILES:-plain,nvfp4,fp8_group128_row,fp8_group128_col,fp8_tensor}" \
        --budget-s "${BENCH1_BUDGET:-470}" --out "$FINAL_OUT/bench1" 2>&1 | tee "$FINAL_OUT/bench1.log" | tail -60 || status=1
    cp -r "$FINAL_OUT/bench1" "$FINAL_OUT/bench1.log" "$OUT/" 2>/dev/null  # into results.tgz too
fi
if step tune; then
    timeout "${TUNE_TIMEOUT:-550}" python3 -m moe_ar_tools.tune --out "$FINAL_OUT/tune.json" \
        --budget-s "${TUNE_BUDGET:-480}" ${TUNE_ARGS:-} 2>&1 | tee "$FINAL_OUT/tune.log" | tail -20 || status=1
    cp "$FINAL_OUT/tune.json" "$FINAL_OUT/tune.log" "$OUT/" 2>/dev/null  # into results.tgz too
fi
exit $status
