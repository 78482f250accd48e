"""Run at 70e0698 with ring.patch applied (shape_constants.applies and serves as they were then;
results: bench_results/world_size_1/stream_ring/ab.json). The streaming program's routes through a ring of loads (kernels/local.cuh local_row_pipelined, under
MOE_AR_STREAM_PIPELINE_DEPTH) against its batched row, with and without shape builds of the
streaming program (as ../streaming_builds/ab.py), interleaved arms in one process; the bench checks
every output of ours against the float64 reference before it times it. Then the Triton kernel once.
    PYTHONPATH=. python experiments/world_size_1/stream_ring/ab.py OUT"""
import contextlib, sys, time
from dispatch import registry, shape_constants
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed_applies, committed_serves, committed_cubin = shape_constants.applies, shape_constants.serves, registry.cached_cubin
REGIMES = (registry.LOCAL_LATENCY_REGIME, registry.LOCAL_STREAMING_REGIME)
extra = [""]


def streaming_applies(regime, row_splits):
    return shape_constants.enabled() and regime in REGIMES and len(row_splits) == 1


def cubin_with_extra(name, target, prefix=""):
    return committed_cubin(name, target, extra[0] + prefix)


registry.cached_cubin = cubin_with_extra
ARMS = [("program0", False, 0), ("builds", True, 0), ("builds_d2", True, 2), ("builds_d3", True, 3),
        ("program_d3", False, 3), ("program1", False, 0)]
SHAPES = "7168:8:shared,4096:8,4096:2,2048:8"
TOKENS = "192,256,512,1024,2048,4096,8192,16384"
for run, built, depth in ARMS:
    shape_constants.applies = streaming_applies if built else committed_applies
    shape_constants.serves = (lambda T: True) if built else committed_serves
    extra[0] = f"#define MOE_AR_STREAM_PIPELINE_DEPTH {depth}\n" if depth else ""
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", SHAPES, "--tokens", TOKENS,
              "--profiles", "plain,fp8_group128_row,fp8_tensor,nvfp4", "--systems", "ours", "--compile-modes",
              "dynamic", "--no-programs", "--budget-s", "150", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
shape_constants.applies, shape_constants.serves, extra[0] = committed_applies, committed_serves, ""
registry._loaded.clear()
t0 = time.perf_counter()
with open(f"{out}/triton.log", "w") as f, contextlib.redirect_stdout(f):
    main(["--world", "1", "--shapes", "7168:8:shared,4096:8", "--tokens", "256,1024,2048,8192",
          "--profiles", "plain,fp8_tensor", "--systems", "ours,triton_fused", "--compile-modes",
          "dynamic", "--no-programs", "--budget-s", "120", "--out", f"{out}/triton"], standalone_mode=False)
print(f"triton: {time.perf_counter() - t0:.0f} s", flush=True)
