"""Run at d2642da with batch.patch applied (results: bench_results/world_size_1/stream_batch/ab.json). The
streaming program's shape builds (dispatch/shape_constants.py) loading 2 (committed), 3 or 4 routes
of a row at a time (MOE_AR_PROBE_STREAM_BATCH), interleaved arms in one process, the bench checking
every output of ours against the float64 reference before it times it; then the smaller shapes
against the Triton kernel from 1,024 tokens.
    PYTHONPATH=. python experiments/world_size_1/stream_batch/ab.py OUT"""
import contextlib, sys, time
from dispatch import registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed_cubin = registry.cached_cubin
extra = [""]


def cubin_with_extra(name, target, prefix=""):
    # the define only where a build's constants are (the committed program never sees it)
    return committed_cubin(name, target, prefix + extra[0] if prefix else prefix)


registry.cached_cubin = cubin_with_extra
ARMS = [("batch2", 0), ("batch4", 4), ("batch3", 3), ("batch2b", 0), ("batch4b", 4)]
for run, batch in ARMS:
    extra[0] = f"#define MOE_AR_PROBE_STREAM_BATCH {batch}\n" if batch else ""
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "7168:8:shared,4096:8,2048:8", "--tokens", "512,1024,2048,4096,8192,16384",
              "--profiles", "plain,fp8_tensor,nvfp4", "--systems", "ours", "--compile-modes",
              "dynamic", "--no-programs", "--budget-s", "120", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
extra[0] = ""
registry._loaded.clear()
t0 = time.perf_counter()
with open(f"{out}/triton.log", "w") as f, contextlib.redirect_stdout(f):
    main(["--world", "1", "--shapes", "4096:8,2048:8,4096:2", "--tokens", "1024,2048,8192",
          "--profiles", "plain,fp8_tensor", "--systems", "ours,triton_fused", "--compile-modes",
          "dynamic", "--no-programs", "--budget-s", "120", "--out", f"{out}/triton"], standalone_mode=False)
print(f"triton: {time.perf_counter() - t0:.0f} s", flush=True)
