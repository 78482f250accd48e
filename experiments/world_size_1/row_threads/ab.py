"""The latency program at H 7168 with its few-tokens row split on 512 threads (16 warps, 2 vectors a
thread, the last 128 vector places masked; the cluster layout then 8 blocks of 2 warps) against the
committed 448 (14 warps; a cluster of 7), interleaved arms in one process, the bench checking every
output of ours against the float64 reference before it times it (the Triton kernel at these token counts: ../floor/probe.py). Run on the
committed tree (row_threads.patch, the change itself, not applied).
    PYTHONPATH=. python experiments/world_size_1/row_threads/ab.py OUT"""
import contextlib, sys, time
from dispatch import registry, workspace
from dispatch.workspace_sizes import RowSplit
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed_row_split = workspace.row_split
threads = [0]  # 0: the committed split; else the few-tokens split of H 7168 on this many threads


def row_split(nvec, vec_per_thread, max_tokens):
    if threads[0] and nvec == 896 and vec_per_thread == 2:
        return RowSplit(max_tokens, threads[0], 2)
    return committed_row_split(nvec, vec_per_thread, max_tokens)


workspace.row_split = row_split
COMMON = ["--world", "1", "--shapes", "7168:8:shared", "--tokens", "1,16,32,48,64,128", "--compile-modes",
          "dynamic", "--no-programs", "--budget-s", "42"]
ALL = "plain,fp8_group128_row,fp8_tensor,nvfp4"
ARMS = [("t448", 0, "ours", ALL), ("t512", 512, "ours", ALL), ("t448b", 0, "ours", ALL), ("t512b", 512, "ours", ALL)]  # the Triton kernel beside the committed split: floor/probe.py
for run, n, systems, profiles in ARMS:
    threads[0] = n
    registry._loaded.clear()  # the shape builds compile the row's threads in: no build reused across arms
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(COMMON + ["--profiles", profiles, "--systems", systems, "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
