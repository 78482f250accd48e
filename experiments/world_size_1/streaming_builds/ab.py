"""Run at 70e0698 (shape_constants.applies and serves as they were then; results:
bench_results/world_size_1/stream_ring/builds_ab.json). The streaming program (local_streaming) built for the call's shape as the latency
program is (dispatch/shape_constants.py: hidden size, row split, top_k and router weight kind as
constants), A/B/A in one process against the program as built for every shape, 192-16,384 tokens.
NVRTC 13, sm_90a, H 7168 top_k 8: 1,256 -> 1,072 SASS instructions for plain, 2,072 -> 1,824 for FP8
group-128, no spills. The bench checks every output of ours before it times it.
    PYTHONPATH=. python experiments/world_size_1/streaming_builds/ab.py OUT"""
import contextlib, sys, time
from dispatch import registry, shape_constants
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed_applies, committed_serves = shape_constants.applies, shape_constants.serves
REGIMES = (registry.LOCAL_LATENCY_REGIME, registry.LOCAL_STREAMING_REGIME)


def streaming_applies(regime, row_splits):
    return shape_constants.enabled() and regime in REGIMES and len(row_splits) == 1


for run in ("program0", "builds", "program1"):
    built = run == "builds"
    # the launcher reads both through the module when it is made and at a signature's first check;
    # serving every T only changes the streaming program (the latency one runs up to its range)
    shape_constants.applies = streaming_applies if built else committed_applies
    shape_constants.serves = (lambda T: True) if built else committed_serves
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "7168:8:shared,4096:8", "--tokens", "192,256,512,1024,2048,4096,8192,16384",
              "--profiles", "plain,fp8_group128_row,fp8_tensor,nvfp4", "--systems", "ours", "--compile-modes",
              "dynamic", "--no-programs", "--budget-s", "150", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
