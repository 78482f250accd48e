"""The latency program's shape builds, A/B in one process, runs interleaved: `generic` (the program as
built for every shape), `full` (dispatch/shape_constants.py: hidden size, row split, top_k and router
weight kind as constants), `row` (hidden size and row split only: one build a workspace and profile).
Then the smaller shapes with `full` against the Triton kernel.
    PYTHONPATH=. python experiments/world_size_1/shape_builds/ab.py OUT"""
import contextlib, os, sys, time
from dispatch import shape_constants
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
full = shape_constants.defines


def row_only(*args):
    return "".join(line + "\n" for line in full(*args).splitlines() if "TOP_K" not in line and "SCALE_KIND" not in line)


def bench(name, env, defines, shapes, systems, budget):
    os.environ[shape_constants.ENV] = env
    shape_constants.defines = defines
    t0 = time.perf_counter()
    with open(f"{out}/{name}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", shapes, "--tokens", "1,16,64,128,256", "--profiles",
              "plain,fp8_group128_row,fp8_tensor,nvfp4", "--systems", systems, "--compile-modes", "dynamic",
              "--no-programs", "--budget-s", str(budget), "--out", f"{out}/{name}"], standalone_mode=False)
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)


arms = {"generic": ("0", full), "full": ("1", full), "row": ("1", row_only)}
for rep in range(2):
    for arm, (env, defines) in (arms.items() if rep == 0 else reversed(list(arms.items()))):
        bench(f"{arm}{rep}", env, defines, "7168:8:shared,4096:8", "ours", 80)
bench("small-full", "1", full, "2048:8,4096:2", "ours,triton_fused", 150)
