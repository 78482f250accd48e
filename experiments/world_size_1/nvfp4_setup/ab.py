"""NVFP4 at few tokens: what the call's set-up costs the latency program, and the cluster kernel's
division for its token (results: bench_results/world_size_1/nvfp4_setup/). Run with setup.patch
applied; its macros pick the arms:
  c            the committed programs (the patch changes no SASS without its macros)
  pad16        MOE_AR_PROBE_PAD16: a 16-byte chunk of scale padding that is all padding rows in one
               store (where scale_out is 16-byte aligned), not four word stores
  under        MOE_AR_PROBE_SETUP_UNDER_LOADS: the latency program fills its reciprocal table and
               zeroes the padding once every load of the block's first row is issued, not before (the
               cluster kernel, 1-48 tokens at H 7168, and the one-block kernel's all-loads path)
  under_pad16  both
  nopad        MOE_AR_PROBE_NOPAD: no padding zeroed at all (the cost bound: the bench checks the
               T rows' dequantized values, not the padding bytes; no layout may ship it)
  c8           MOE_AR_PROBE_FIXED_C 8: the cluster kernel's token as blockIdx.x / 8, the cluster's
               blocks at H 7168 known when built, not a division by a run-time value before the
               token's index loads (every profile)
Interleaved in one process, each arm twice (the six, then all but nopad again); c and c8 time plain
too. Every output of ours is checked against the float64 reference before it is timed.
    git apply experiments/world_size_1/nvfp4_setup/setup.patch && PYTHONPATH=. python -m generator.cli
    PYTHONPATH=. python experiments/world_size_1/nvfp4_setup/ab.py OUT [BUDGET_S]"""
import contextlib
import sys
import time

from dispatch import registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 18.0
committed_cubin = registry.cached_cubin
extra = [""]


def cubin_with_extra(name, target, prefix=""):
    return committed_cubin(name, target, extra[0] + prefix)


registry.cached_cubin = cubin_with_extra
PAD16 = "#define MOE_AR_PROBE_PAD16 1\n"
UNDER = "#define MOE_AR_PROBE_SETUP_UNDER_LOADS 1\n"
NOPAD = "#define MOE_AR_PROBE_NOPAD 1\n"
C8 = "#define MOE_AR_PROBE_FIXED_C 8\n"
FIRST = [("c", ""), ("pad16", PAD16), ("under", UNDER), ("under_pad16", UNDER + PAD16), ("nopad", NOPAD), ("c8", C8)]
ARMS = FIRST + [(name + "_b", define) for name, define in FIRST if name != "nopad"]
for run, define in ARMS:
    extra[0] = define
    registry._loaded.clear()
    t0 = time.perf_counter()
    both = run.split("_")[0] in ("c", "c8")
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", "1,16,32,48,64,128",
              "--profiles", "plain,nvfp4" if both else "nvfp4", "--systems", "ours", "--compile-modes", "dynamic",
              "--no-programs", "--budget-s", str(2 * budget if both else budget), "--out", f"{out}/{run}"],
             standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
