"""Benchmark of the fused MoE finalize + all-reduce + residual + RMSNorm (+ NVFP4) op against
unfused baselines, following docs/measurement.md.

    moe-ar-bench --out bench_results/run.json          (or python -m moe_ar_tools.bench)

on a machine with at least --world GPUs (default 2). It writes the JSON (--out, default
bench_results/<machine>-<date>.json; rewritten after every shape, so a killed run keeps what it
measured), a PNG plot and a .summary.txt table beside it, and prints the table. The default
sweep (docs/measurement.md's four shapes, 1..16384 tokens, profiles plain and nvfp4) is sized for about 8
minutes on 2x H200; --time-budget-s stops it early (the JSON then says "truncated": true).

What it measures, per shape (hidden, top_k, shared expert), token count T and output profile
("plain": bf16/fp16 outputs; "nvfp4": + NVFP4), on W GPUs with one process each:

  nccl+torch   the unfused step: finalize with torch ops (gather the expert rows, weight them
               by the router scales times routed_scaling_factor, sum over top_k, add the shared
               expert), NCCL all_reduce, residual add and RMSNorm with torch ops. Plain profile only
               (torch has no NVFP4 quantizer to compare with).
  symm+torch   the same torch ops around torch's symmetric-memory all-reduce, one-shot and
               two-shot (peer loads/stores, never NVLink multicast), where the installed torch
               offers it. Plain profile only. Records carry `variant`.
  nccl+compiled, symm+compiled
               the same two steps with the finalize and the residual + RMSNorm epilogue each
               wrapped in torch.compile (inductor, fullgraph, static shapes; compiled per shape
               before capture, the compiled code captured in the graph around the all-reduce):
               the best unfused step a user gets without our kernel. A compile failure skips
               them for the rest of the run, with the reason recorded.
  auto         dispatch.moe_finalize_allreduce with the dispatcher choosing the program.
  auto+quant   FP8 profiles only: the unfused alternative to a fused FP8 output, i.e. auto with
               plain output (profile plain) followed by a separate FP8 quantization kernel
               (one launch, one read of norm_out, the same rule, bytes checked like ours).
  <program>    every generated program of this dtype / world size / profile, forced by name.

Timing protocol: every system's step is captured in one CUDA graph of `calls` back-to-back
calls (static inputs, rotating among a few input sets so that L2 cannot hold them all at large
T); the graphs are replayed interleaved, each system once a round, in an order shuffled per
round (A C B, B A C, ...: no system always follows the same one or comes first). Each replay is
timed with CUDA events on every rank; a replay's time is the maximum over ranks (the slowest
rank is the step time), divided by `calls`. A record's median_us is the median over `reps`
replays; ratios are medians of per-replay ratios against the baseline replayed in the same
round, so drift cancels. ratio_vs_best_baseline is against the unfused baseline (nccl/symm, torch
or compiled, any variant) with the smallest median at that point in the same run.

Correctness: outputs are checked against a float64 reference (each rank's partial rounded to
the dtype once, summed across ranks in float64, residual rounded once, RMSNorm in float64)
with a norm-relative tolerance, before and after the timed replays, and compared bit for bit
across ranks; NVFP4 outputs are dequantized and compared with the kernel's own norm_out. A
failed check voids the record (`"valid": false` with the reason).

Roofline: the bytes the op must move through HBM and over NVLink (per rank, by exchange
regime), divided by the HBM and peer-copy bandwidths measured in the same run; the floor is
the larger of the two times.

The modules, by concern: config (systems, profiles, tolerances, shapes, the run's options),
roofline (byte counts, bandwidth), timing (statistics, replay orders, input-set rotation), records
(the JSON records and their metadata), summary (the table), plotting, inputs (random inputs,
their float64 check values and the checks' error measure: rel_err, worst), systems (the unfused
baselines, symmetric memory), fp8_quant (the auto+quant kernel), worker, point and sweep (one rank:
its setup, one point, the sweep), cold_start, cli (the command). The pure-Python parts are tested
on CPU by tests/test_bench_cpu.py; everything that needs a GPU is imported lazily, so that every
module imports without one.
"""
# Helpers other tools import from the package (the modules above are their home).
from moe_ar_tools.bench.plotting import plot
from moe_ar_tools.bench.records import _driver_version, _versions, jsonable
from moe_ar_tools.bench.roofline import hbm_bytes, measure_bandwidth
from moe_ar_tools.bench.timing import input_sets_for, median, pair_ratio, replay_orders
