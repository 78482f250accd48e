"""GPU: the streaming builds' row in the Triton kernel's order (natural.py, arm 1) against the
committed row, interleaved arms in one process (base, nat1, base, nat1), the bench checking every
output of ours against the float64 reference before timing it; the first arm with the Triton kernel
beside ours.
    PYTHONPATH=. python experiments/world_size_1/stream_natural_order/ab_natural.py OUT [TOKENS] [SHAPES]
NAT_BUDGET (default 200) is each arm's bench budget in seconds."""
import contextlib
import os
import sys
import time

import natural
from dispatch import registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
TOKENS = sys.argv[2] if len(sys.argv) > 2 else "256,512,1024,2048,8192"
SHAPES = sys.argv[3] if len(sys.argv) > 3 else "7168:8:shared"
BUDGET = os.environ.get("NAT_BUDGET", "200")
ARMS = [("base", 0, "ours,triton_fused"), ("nat1", 1, "ours"), ("base2", 0, "ours"), ("nat1b", 1, "ours")]
for run, arm, systems in ARMS:
    natural.NATURAL[0] = arm
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", SHAPES, "--tokens", TOKENS, "--profiles", "plain,fp8_tensor,nvfp4",
              "--systems", systems, "--compile-modes", "dynamic", "--no-programs", "--budget-s", BUDGET,
              "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
