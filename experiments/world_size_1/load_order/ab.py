"""World size 1's latency program with its kernels bounded to one block a multiprocessor
(`__launch_bounds__(512, 1)`: ptxas may give a thread 128 registers and then issues a row's loads
before its first addition) against the committed bound (`__launch_bounds__(512)`: the one-block
shape builds take 86-114 registers and issue about half of the row's loads first, the rest between
the additions), A/B/A/B in one process, each arm the world-size-1 bench (every output of ours
checked against the float64 reference before it is timed), ours only. The arm's source is the
committed program's with the bound replaced (the cache keys the source, so each arm compiles its own).
    PYTHONPATH=. python experiments/world_size_1/load_order/ab.py OUT [SHAPES] [TOKENS] [BUDGET_S]"""
import contextlib
import sys
import time

from dispatch import registry
from moe_ar_common import manifest_reader
from moe_ar_tools.bench.cli import main

COMMITTED = "__launch_bounds__(512) moe_ar_local_"
ONE_BLOCK = "__launch_bounds__(512, 1) moe_ar_local_"
tree_source_for = manifest_reader.source_for


def one_block_source_for(manifest, directory, name):
    text = tree_source_for(manifest, directory, name)
    if registry.program_info(name)["regime"] == registry.LOCAL_LATENCY_REGIME:
        assert COMMITTED in text, name
        text = text.replace(COMMITTED, ONE_BLOCK)
    return text


out = sys.argv[1]
shapes = sys.argv[2] if len(sys.argv) > 2 else "2048:8,4096:8"
tokens = sys.argv[3] if len(sys.argv) > 3 else "1,32,48,64,128,256"
budget = sys.argv[4] if len(sys.argv) > 4 else "100"
for run in ("tree", "bound", "treeb", "boundb"):
    manifest_reader.source_for = one_block_source_for if run.startswith("bound") else tree_source_for
    registry._loaded.clear()  # a loaded program is kept per (name, device, prefix)
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        main(["--world", "1", "--shapes", shapes, "--tokens", tokens, "--profiles", "plain,fp8_group128_row,nvfp4",
              "--systems", "ours", "--compile-modes", "dynamic", "--no-programs", "--budget-s", budget,
              "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
