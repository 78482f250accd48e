"""The shape builds' range (shape_constants.MAX_TOKENS) at 64 as committed and at 256, A/B/A in one
process, now that a build issues every load of a row at once: does a build win above 64 tokens?
(H 4096 and 2048 top_k 8, whose latency range goes to 256 tokens, and H 7168 + shared, to 128.)
Ran at 432dfb9, whose builds left the four-routes path out (superseded by 437679b).
    PYTHONPATH=. python experiments/world_size_1/all_loads/max_tokens.py OUT"""
import contextlib, sys, time
from dispatch import registry, shape_constants
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
for run, n in (("max64a", 64), ("max256", 256), ("max64b", 64)):
    shape_constants.MAX_TOKENS = n  # serves() reads it at each call signature's first check
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "4096:8,2048:8,7168:8:shared", "--tokens", "80,96,128,192,256",
              "--profiles", "plain,fp8_tensor", "--systems", "ours", "--compile-modes", "dynamic", "--no-programs",
              "--budget-s", "60", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
