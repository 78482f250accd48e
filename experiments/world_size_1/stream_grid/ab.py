"""World size 1's streaming program on a grid of a block a token (the hardware hands each free block
slot the next token, as the Triton kernel's grid of T programs does) against the committed grid of the
blocks resident at once (each block strides over the tokens: a static share, 7 or 8 tokens at 2,048),
interleaved arms in one process, the bench checking every output of ours against the float64
reference before it times it; then the Triton kernel.
    PYTHONPATH=. python experiments/world_size_1/stream_grid/ab.py OUT"""
import contextlib, sys, time
from dispatch import launcher, registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed = launcher._Launcher.config_for
per_token = [False]  # True: the streaming program's grid is T blocks


def config_for(self, ws, T, pdl, top_k, max_blocks=None):
    config = committed(self, ws, T, pdl, top_k, max_blocks)
    if per_token[0] and self.regime == registry.LOCAL_STREAMING_REGIME:
        config.gridDimX = T
    return config


launcher._Launcher.config_for = config_for
TOKENS = "256,1024,2048,8192"
COMMON = ["--world", "1", "--shapes", "7168:8:shared,4096:2", "--tokens", TOKENS, "--compile-modes", "dynamic",
          "--no-programs"]
for run, p in [("limit", False), ("tokens", True), ("limitb", False), ("tokensb", True)]:
    per_token[0] = p
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(COMMON + ["--profiles", "plain,fp8_tensor,nvfp4,fp8_group128_row", "--systems", "ours",
                       "--budget-s", "50", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
per_token[0] = False
t0 = time.perf_counter()
with open(f"{out}/triton.log", "w") as f, contextlib.redirect_stdout(f):
    main(COMMON + ["--profiles", "plain", "--systems", "ours,triton_fused", "--budget-s", "40",
                   "--out", f"{out}/triton"], standalone_mode=False)
print(f"triton: {time.perf_counter() - t0:.0f} s", flush=True)
