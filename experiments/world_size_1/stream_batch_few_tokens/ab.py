"""GPU: the streaming builds loading 2 (committed) or 4 routes at a time (probe.py), interleaved arms
in one process (base, b4, base, b4), the bench checking every output of ours against the float64
reference before timing it; the first arm with the Triton kernel beside ours.
    PYTHONPATH=. python experiments/world_size_1/stream_batch_few_tokens/ab.py OUT"""
import contextlib
import sys
import time

import probe  # noqa: F401  (patches the registry)
from dispatch import registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
TOKENS = sys.argv[2] if len(sys.argv) > 2 else "160,192,256,384,512"
ARMS = [("base", 0, "ours,triton_fused"), ("b4", 4, "ours"), ("base2", 0, "ours"), ("b4b", 4, "ours")]
for run, b, systems in ARMS:
    probe.batch[0] = b
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", TOKENS, "--profiles", "plain,fp8_tensor,nvfp4",
              "--systems", systems, "--compile-modes", "dynamic", "--no-programs", "--budget-s", "200",
              "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
