"""World size 1's plugin of the harness (moe-ar-bench --world 1): ours against the best unfused
chains on one GPU, every system in one run. The operation: finalize (top-k rows x router weights x
routed_scaling_factor + shared expert) + residual add + RMSNorm + an optional quantization,
residual_out rounded once.

Systems at each point (shape, token count T, output profile, L2 mode):
  ours           dispatch.moe_finalize_allreduce on a dispatch.LocalWorkspace, the automatic choice
                 (`program` says which); where a cell has more than one world-size-1 program, each is
                 also forced (`programs`); ours_pdl the same launched with PDL
  triton_fused   the whole tail in one Triton launch; chain: a Triton gather-sum, then FlashInfer's or a
                 Triton add + RMSNorm (moe_ar_tools/baselines/triton_fused.py), every num_warps timed
  torch_eager    baselines/torch_chain.py: gather + weighted sum + shared + add + torch's rms_norm +
                 the quantization in torch (NVFP4 with 128x4 swizzled scales, FP8 group-128 row / column
                 scales, FP8 per-tensor)
  torch_compile  the same under torch.compile (inductor), compiled with dynamic shapes (once for every
                 T; every shape) and per T (static, as engines capture fixed sizes; --static-compile-shapes,
                 the target shape by default); the faster per point, `compile_mode` says which
  flashinfer     the compiled torch finalize then FlashInfer's fused_add_rmsnorm (plain) or
                 fused_add_rmsnorm_quant (fp8_tensor: FP8 only, it writes no bf16 norm_out), in place on
                 the residual as engines call them, with FlashInfer's default PDL; null with the reason
                 where FlashInfer has no such kernel on the GPU (NVFP4: sm_100+ only; FP8 per-token-group:
                 none) or its kernels are not at hand (baselines/flashinfer_norm.py)

summary.json names, per hidden size, the selection tables that chose ours' programs (`tables`: set
and why; a device no committed set matches runs the written model), and table.md prints it.

Floor, measured in the same run: the device-to-device copy bandwidth (read + write counted) and the
read bandwidth of a streaming-read kernel (roofline.measure_bandwidth, measure_read_bandwidth), an
empty kernel timed like every system, ours at 1 token (the first shape, plain) with and without PDL.

Correctness, before timing and again after it, every system: residual_out and norm_out against the
float64 reference of the world-size-1 contract (inputs.contract_outputs without a process group)
within TOLERANCE_U units of roundoff, quantized outputs dequantized against the system's own norm_out
(the reference's where it writes none); outputs are poisoned first. A wrong result voids the system
at that point (null, with the reason).

Targets (summary.check_targets): >= 88% of the copy bandwidth from 2,048 tokens for plain and FP8
(NVFP4 >= 85%), never slower than any baseline, geometric mean over T of the speed-up over the
fastest baseline >= 2, and at 1 token at most twice the empty kernel.

The modules: config (systems, profiles, vocabulary, the plan), summary (bytes and roofline, records,
summary rows, targets, summary.json), report (the table and the plot's panels), systems (System,
the empty kernel, dequantization; Setup: the run's state and the systems it builds at a point),
runner (Runner: capture, check, time, the floor, the sweep, the files).
"""
