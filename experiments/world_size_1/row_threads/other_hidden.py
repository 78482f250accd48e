"""The latency program's row split rounded to whole clusters of 8 blocks (dispatch/workspace_sizes.py
cluster_row_split) where it changes the launch besides H 7168: H 6144 (12 warps rounded to 16, a
cluster of 8 blocks of 2 warps, the last 256 vector places masked, against a cluster of 6), top_k 2
and 8, A/B/A/B in one process, the bench checking every output of ours against the float64 reference
before it times it; then the Triton kernel. Run on the tree with row_threads.patch applied.
    PYTHONPATH=. python experiments/world_size_1/row_threads/other_hidden.py OUT [SHAPES [BUDGET_S]]
(run 2: SHAPES 6144:8, BUDGET_S 25)"""
import contextlib, sys, time
from dispatch import registry, workspace
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed = workspace.cluster_row_split
rounded = [True]


def cluster_row_split(split, *args):
    return committed(split, *args) if rounded[0] else split


workspace.cluster_row_split = cluster_row_split
shapes = sys.argv[2] if len(sys.argv) > 2 else "6144:2,6144:8"
budget = sys.argv[3] if len(sys.argv) > 3 else "45"
COMMON = ["--world", "1", "--shapes", shapes, "--tokens", "1,16,32,48,64", "--compile-modes", "dynamic",
          "--no-programs", "--budget-s", budget]
ARMS = [("c8", True, "ours"), ("c6", False, "ours"), ("c8b", True, "ours"), ("c6b", False, "ours"),
        ("triton", True, "ours,triton_fused")]
for run, r, systems in ARMS:
    rounded[0] = r
    registry._loaded.clear()  # the shape builds compile the row's threads in: no build reused across arms
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(COMMON + ["--profiles", "plain,fp8_tensor,nvfp4" if systems == "ours" else "plain,fp8_tensor",
                       "--systems", systems, "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
