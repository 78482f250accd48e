"""World size 1: ours against the best unfused chains on one GPU.

    moe-ar-bench-one --out DIR          (or python -m moe_ar_tools.bench_one; --dry-run: the plan only)

One GPU, every system in one run. DIR gets summary.json (one row per point, the targets checked),
records.json (every system's replay times), latency.png (latency against tokens, log-log, one
panel per profile, the target shape) and table.md (the short table bench_results/world_size_1/
shows). The operation: finalize (top-k rows x router weights x routed_scaling_factor + shared
expert) + residual add + RMSNorm + an optional quantization, residual_out rounded once.

Systems at each point (shape, token count T, output profile):
  ours           dispatch.moe_finalize_allreduce on a dispatch.LocalWorkspace (world size 1), the
                 automatic choice (`program` says which); where a cell has more than one world-size-1
                 program, each is also forced (`programs`)
  torch_eager    baselines/torch_chain.py: gather + weighted sum + shared + add + torch's rms_norm +
                 the quantization in torch (NVFP4 with 128x4 swizzled scales, FP8 group-128 row / column
                 scales, FP8 per-tensor), captured in a CUDA graph
  torch_compile  the same under torch.compile (inductor), compiled with dynamic shapes (once for every
                 T; every shape) and per T (static, as engines capture fixed sizes; --static-compile-shapes,
                 the target shape by default); the faster per point, `compile_mode` says which
  flashinfer     the compiled torch finalize (the faster mode) then FlashInfer's fused_add_rmsnorm
                 (plain) or fused_add_rmsnorm_quant (fp8_tensor: FP8 only, it writes no bf16 norm_out), in
                 place on the residual as engines call them, with FlashInfer's default PDL; null with the
                 reason where FlashInfer has no such kernel on the GPU (NVFP4: sm_100+ only; FP8
                 per-token-group: none) or its kernels are not at hand (baselines/flashinfer_norm.py)

summary.json also names, per hidden size, the selection tables that chose ours' programs (`tables`:
set and why; a device no committed set matches runs the written model), and table.md prints it.

Floor, measured in the same run: the device-to-device copy bandwidth (read + write counted,
moe_ar_tools.bench.roofline.measure_bandwidth), an empty kernel timed like every system (graph replays of
back-to-back empty kernels), ours at 1 token (target shape, plain) with and without PDL.

Timing (docs/measurement.md on one GPU): each system's calls are captured in one CUDA graph of
--calls back-to-back calls rotating over input sets that together exceed twice the L2; the graphs
are replayed --reps rounds (at least 50), every system once a round in an order shuffled per round;
a point's time is the median replay / calls; ratios are medians of per-round ratios (baseline /
ours: above 1, ours is faster).

Correctness, before timing and again after it, every system: residual_out and norm_out against the
float64 reference of the world-size-1 contract (residual_out = D(partial + residual_in), rounded
once; RMSNorm in float64) within TOLERANCE_U units of roundoff (norm-relative), quantized outputs
dequantized against the system's own norm_out (the reference's where it writes none); outputs
are poisoned first. A wrong result voids the system at that point (null, with the reason).

Roofline: the bytes the operation must move (hbm_bytes_ws1: expert rows, routing, shared expert,
residual and gamma read, outputs, quantized outputs and scales written) over the copy bandwidth.
Targets (check_targets): >= 88% of the copy bandwidth from 2,048 tokens for plain and FP8 (NVFP4
>= 85%), never slower than any baseline, geometric mean over T of the speed-up over the fastest
baseline >= 2, and at 1 token at most twice the empty kernel.

--budget-s: no point starts when the longest point so far would end past it; what is left is
recorded as skipped.

The modules, by concern: config (systems, profiles, the run's options, the plan), summary (bytes and
roofline, records, summary rows, targets, summary.json), report (the table and the plot), systems
(System, ours' outputs, the empty kernel, the float64 check values; Setup: the run's state and the
systems it builds at a point), runner (Runner: capture, check, time, the floor, the sweep, the
files), cli (the command). Shapes, tolerances, the op's constants, inputs, statistics and the copy
bandwidth come from the world-size>=2 benchmark's modules (moe_ar_tools.bench.config, .inputs,
.timing, .roofline, .records). The pure-Python parts are tested on CPU
(tests/test_bench_world_one_cpu.py); everything that needs a GPU is imported lazily, so that every
module imports without one.
"""
