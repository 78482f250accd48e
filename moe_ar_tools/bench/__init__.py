"""The benchmark of the fused MoE finalize (+ all-reduce) + residual + RMSNorm (+ quantization) op
against the unfused ways to run it, one harness with the world size a parameter
(docs/measurement.md):

    moe-ar-bench --world 2 --out bench_results/run.json     (or python -m moe_ar_tools.bench)
    moe-ar-bench --world 1 --out DIR                        (one GPU; --dry-run: the plan only)

World size 2 and up (plugin multi_gpu/, one process a GPU, NCCL between them), per shape, token
count and output profile:
  nccl+torch, symm+torch       the unfused step: finalize with torch ops, NCCL's or torch symmetric
                               memory's all-reduce (one-shot and two-shot, `variant`), residual add and
                               RMSNorm with torch ops (plain profile only)
  nccl+compiled, symm+compiled the same with the torch ops under torch.compile (inductor, static shapes)
  auto                         dispatch.moe_finalize_allreduce, the dispatcher choosing the program
  auto+quant                   FP8 profiles: auto plain, then a separate FP8 quantization kernel
  <program>                    every generated program of the dtype / world size / profile, forced
It writes the JSON (--out, default bench_results/<machine>-<date>.json; rewritten after every shape,
so a killed run keeps what it measured), a PNG plot and a .summary.txt table beside it. The
default sweep (four shapes, 1..16384 tokens, profiles plain and nvfp4) is sized for about 8 minutes
on 2x H200; --budget-s stops it early ("truncated": true). The generator's table sets are fitted to
such a JSON (generator/table_sets.py COMMITTED_SETS: the header's gpu, world_size, bandwidth,
driver, versions, commit, date; the records' system, valid, emulated, shape, tokens, median_us,
p10_us, p90_us).

World size 1 (plugin world_one/, one GPU, dispatch.LocalWorkspace): ours (the automatic choice, each
world-size-1 program forced where a cell has several), ours_pdl, a fused Triton kernel, the Triton
chain, the eager and compiled torch chains and FlashInfer's norm kernels (moe_ar_tools/baselines/), in
two L2 modes (cold: input sets of more than 3x the L2; warm: one set), against the copy bandwidth's
roofline and the read floor. DIR gets summary.json (one row per point, the targets checked),
records.json (every system's replay times), table.md and latency.png; --budget-s starts no point
that would end past it.

Timing (timing.py, every world size): each system's calls are captured in one CUDA graph of --calls
back-to-back calls rotating over input sets (together at least twice the L2, or 3x at world size
1's cold L2); the graphs are replayed --reps rounds, every system once a round in an order shuffled
per round; each replay is timed with CUDA events (at world size 2+ on every rank, the slowest rank's
time kept), divided by the calls. A point's time is the median replay; ratios are medians of
per-round ratios, so drift cancels. Every system's outputs are checked against the float64
reference before and after its timed replays (and across ranks bit for bit); a failed check voids
the record ("valid": false with the reason).

The modules, by concern: config (the op's constants, profiles, tolerances, shapes, the options:
Config and make_config), timing (statistics, replay orders, input-set rotation, graph capture and
timed replays), inputs (random inputs, their float64 check values, the error measure), outputs
(output buffers, poison), torch_ops (the finalize and epilogue in torch ops), roofline (byte counts,
the copy bandwidth, the read floor), records (the record format, the header, the file writes),
plotting (the one plot), cli (the command); multi_gpu/ and world_one/ the systems, the runs and the
reports of each kind of world size. Everything that needs a GPU is imported lazily, so that every
module imports without one; the CPU tests (tests/test_bench_cpu.py, tests/test_bench_world_one_cpu.py)
run the parts that need none, and whole runs with the GPU stubbed.
"""
