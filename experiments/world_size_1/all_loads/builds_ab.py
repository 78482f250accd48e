"""The shape builds as committed at 05f7a11 (calls of up to 64 tokens, every load of a row at once up to
16, four routes at a time above) against the builds of this tree (every call of the latency program up
to shape_constants.MAX_TOKENS, every load at once at each), A/B/A in one process, 1-256 tokens.
    PYTHONPATH=. python experiments/world_size_1/all_loads/builds_ab.py OUT"""
import contextlib, sys, time
from dispatch import registry, shape_constants
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
tree_max, tree_defines = shape_constants.MAX_TOKENS, shape_constants.defines


def before_defines(*args, **kwargs):
    line = f"#define MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS {shape_constants.MAX_TOKENS}\n"
    text = tree_defines(*args, **kwargs)
    assert line in text
    return text.replace(line, "#define MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS 16\n")


for run in ("before0", "tree", "before1"):
    before = run.startswith("before")
    shape_constants.MAX_TOKENS = 64 if before else tree_max
    shape_constants.defines = before_defines if before else tree_defines
    registry._loaded.clear()  # a loaded program is kept per (name, device, prefix)
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "4096:8,2048:8,4096:2,7168:8:shared", "--tokens",
              "1,16,32,64,96,128,192,256", "--profiles", "plain,fp8_tensor,nvfp4", "--systems", "ours",
              "--compile-modes", "dynamic", "--no-programs", "--budget-s", "100", "--out", f"{out}/{run}"],
             standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
