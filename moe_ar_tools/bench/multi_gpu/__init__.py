"""World size 2 and up, the harness's plugin (moe-ar-bench --world W): the fused op against NCCL and
torch symmetric memory on W GPUs of this machine, one process each.

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
               before capture, the compiled code captured in the graph around the all-reduce). A
               compile failure skips them for the rest of the run, with the reason recorded.
  auto         dispatch.moe_finalize_allreduce with the dispatcher choosing the program.
  auto+quant   FP8 profiles only: auto with plain output followed by a separate FP8 quantization
               kernel (one launch, one read of norm_out, the same rule, bytes checked like ours).
  <program>    every generated program of this dtype / world size / profile, forced by name.

A replay's time is the maximum over ranks (the slowest rank is the step time). ratio_vs_best_baseline
is against the unfused baseline (any variant) with the smallest median at that point. Outputs are
checked against the float64 reference (each rank's partial rounded to the dtype once, summed across
ranks in float64) and compared bit for bit across ranks. Roofline: the bytes the op must move
through HBM and over NVLink (per rank, by exchange regime) over the bandwidths measured in the same
run; the floor is the larger of the two times.

The modules: config (systems, vocabulary, the plan), systems (the unfused baselines, symmetric
memory), fp8_quant (the auto+quant kernel), worker, point and sweep (one rank: its setup, one point,
the sweep), summary (the table and the plot's panels), cold_start, launch (the processes).
"""
