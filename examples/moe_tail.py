"""Integration example: the tail of a tensor-parallel MoE layer, fused vs unfused, on 2 processes.

    torchrun --nproc-per-node 2 examples/moe_tail.py
    torchrun --nproc-per-node 2 examples/moe_tail.py --tokens 1,64,512,2048 --hidden 4096 --quant nvfp4
    torchrun --nproc-per-node 2 examples/moe_tail.py --compile      (the op inside torch.compile)

from the repository root, with the project installed (pip install -e .) or PYTHONPATH=. set.

Each process (one GPU, NCCL process group) holds its tensor-parallel share of a MoE layer's
output: the FC2 rows of its experts for every routed (token, expert) pair, permuted by expert
(`allreduce_in`), the routing (`expanded_idx_to_permuted_idx`, router weights), its share of the
shared expert's output, and the replicated residual stream and RMSNorm weight. The layer tail
turns that into the next layer's input:

    fused     dispatch.moe_finalize_allreduce_op (the moe_ar custom op): one kernel per rank
    unfused   torch: gather the rows, weight and sum them (bmm), add the shared expert,
              NCCL all_reduce, residual add, RMSNorm

For every token count it checks that both agree (norm-relative error of residual_out and
norm_out within 8 unit roundoffs of the dtype, from any rank; NVFP4 bytes dequantized against
the kernel's own norm_out), then times both as CUDA graphs of --calls back-to-back calls,
replayed --replays times: per replay the slowest rank's time, the median over replays, divided
by --calls. Rank 0 prints one line per token count. Exits 1 if a check failed. The unit roundoffs
and the NVFP4 dequantization come from moe_ar_tools.reference (the project's float64 reference).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set in os.environ before the process group exists).

Importable without a GPU; everything that needs one happens in main().
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TOLERANCE_U = 8            # norm-relative, in unit roundoffs of the dtype
NVFP4_TOLERANCE = 0.25     # dequantized NVFP4 vs the kernel's norm_out, norm-relative
ROUTED_SCALING_FACTOR = 2.5
EPS = 1e-6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/moe_tail.py", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8,128,1024", help="comma-separated token counts (default %(default)s)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="routed experts (only shapes the routing)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-shared", action="store_true", help="no shared expert")
    p.add_argument("--quant", choices=("none", "nvfp4"), default="none", help="fused path also writes NVFP4")
    p.add_argument("--compile", action="store_true", help="call the op from a torch.compile(fullgraph=True) function")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per CUDA graph")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=60.0, help="workspace deadline for a missing peer")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.token_counts = [int(t) for t in a.tokens.split(",") if t.strip()]
    if not a.token_counts or min(a.token_counts) < 1:
        p.error("--tokens: positive integers, comma-separated")
    return a


# ---- inputs --------------------------------------------------------------------------------------

def make_inputs(args, T: int, rank: int, device, dtype) -> dict:
    """One rank's inputs. Routing, router weights, residual and RMSNorm weight are drawn from a
    generator shared by all ranks (tensor parallelism replicates them); expert outputs and the
    shared expert's partial output from a per-rank generator."""
    import torch
    H, K, E = args.hidden, args.top_k, args.experts
    common = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + T)
    mine = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + T + 7919 * (rank + 1))
    # top-k routing and renormalized router weights (fp32)
    logits = torch.randn(T, E, generator=common, device=device)
    top_logits, experts = logits.topk(K, dim=-1)
    scale = torch.softmax(top_logits, dim=-1)
    # permute the T*K routed rows by expert, as a grouped GEMM lays them out
    order = torch.argsort(experts.reshape(-1), stable=True)
    idx = torch.empty_like(order)
    idx[order] = torch.arange(T * K, device=device)
    idx = idx.view(T, K).to(torch.int32)
    residual = torch.randn(T, H, generator=common, device=device).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(H, generator=common, device=device)).to(dtype)
    allreduce_in = (0.5 * torch.randn(T * K, H, generator=mine, device=device)).to(dtype)
    shared = None if args.no_shared else (0.5 * torch.randn(T, H, generator=mine, device=device)).to(dtype)
    return dict(allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=idx, expert_scale_factor=scale,
                shared_expert_output=shared, residual_in=residual, norm_weight=norm_weight)


# ---- the two implementations ---------------------------------------------------------------------

def unfused_tail(inputs: dict, group):
    """(norm_out, residual_out) with torch ops and NCCL, as an engine without fusion runs them."""
    import torch
    import torch.distributed as dist
    idx = inputs["expanded_idx_to_permuted_idx"]
    T, K = idx.shape
    rows = inputs["allreduce_in"].index_select(0, idx.reshape(-1)).view(T, K, -1)        # gather
    weights = (inputs["expert_scale_factor"] * ROUTED_SCALING_FACTOR).to(rows.dtype).unsqueeze(1)
    partial = torch.bmm(weights, rows).squeeze(1)                                    # scale + sum over top_k
    if inputs["shared_expert_output"] is not None:
        partial = partial + inputs["shared_expert_output"]
    dist.all_reduce(partial, group=group)                                            # NCCL
    residual_out = partial + inputs["residual_in"]
    hidden = residual_out.float()
    norm_out = (hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + EPS)).to(partial.dtype) * \
        inputs["norm_weight"]
    return norm_out, residual_out


def fused_tail(handle, allreduce_in, expanded_idx_to_permuted_idx, expert_scale_factor, shared_expert_output,
               residual_in, norm_weight, quant, global_scale):
    """The same tail through the moe_ar custom op (compiles with fullgraph=True)."""
    import dispatch
    return dispatch.moe_finalize_allreduce_op(
        handle, allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
        expert_scale_factor=expert_scale_factor, routed_scaling_factor=ROUTED_SCALING_FACTOR,
        shared_expert_output=shared_expert_output, residual_in=residual_in, norm_weight=norm_weight, eps=EPS,
        quant=quant, global_scale=global_scale)


# ---- checks and timing ---------------------------------------------------------------------------

def rel_err(a, b) -> float:
    import torch
    d = torch.linalg.vector_norm(a.float() - b.float())
    n = torch.linalg.vector_norm(b.float())
    return float(d / n) if float(n) > 0 else float(d)


def worst_over_ranks(values: list, device) -> list:
    """Element-wise maximum over ranks (NaN counts as the worst)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([v if v == v else float("inf") for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def graph_time_us(step, calls: int, replays: int, warmup: int, device):
    """Median over replays of the slowest rank's time of one CUDA-graph replay of `calls` calls
    of step(), divided by `calls` (microseconds). Returns (time, the last call's outputs, the graph)."""
    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        step()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            out = step()
    torch.cuda.synchronize(device)
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    ms = torch.tensor([s.elapsed_time(e) for s, e in events], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # per replay: the slowest rank
    return statistics.median(ms.tolist()) * 1e3 / calls, out, graph


def run(args) -> bool:
    import torch
    import torch.distributed as dist
    import dispatch
    from moe_ar_tools.reference import UNIT_ROUNDOFF, nvfp4_dequant

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    quant = None if args.quant == "none" else "nvfp4"
    tol = TOLERANCE_U * UNIT_ROUNDOFF[dtype]
    ws = dispatch.Workspace(dist.group.WORLD, max(args.token_counts), args.hidden, dtype, timeout_s=args.timeout_s)
    handle = dispatch.workspace_handle(ws)
    fused = torch.compile(fused_tail, fullgraph=True) if args.compile else fused_tail
    if rank == 0:
        print(f"world {world}, hidden {args.hidden}, top_k {args.top_k}, {args.dtype}, "
              f"shared expert {'no' if args.no_shared else 'yes'}, quant {args.quant}"
              f"{', torch.compile' if args.compile else ''}; CUDA graphs of {args.calls} calls, "
              f"median of {args.replays} replays, slowest rank")
        print(f"{'tokens':>7} {'program':<26} {'fused_us':>9} {'unfused_us':>10} {'speedup':>7} "
              f"{'res_err':>9} {'norm_err':>9} {'nvfp4_err':>9}  check (tolerance {tol:.2g})")
    all_ok = True
    try:
        for T in args.token_counts:
            inputs = make_inputs(args, T, rank, device, dtype)
            program = dispatch.select_program(ws, T, quant, inputs["shared_expert_output"] is not None,
                                               top_k=args.top_k)
            gs = torch.ones(1, dtype=torch.float32, device=device)

            def fused_step():
                return fused(handle, inputs["allreduce_in"], inputs["expanded_idx_to_permuted_idx"],
                             inputs["expert_scale_factor"], inputs["shared_expert_output"], inputs["residual_in"],
                             inputs["norm_weight"], quant, gs if quant else None)

            # correctness, eager: both paths on the same inputs
            unfused_norm, unfused_res = unfused_tail(inputs, dist.group.WORLD)
            if quant:  # the usual NVFP4 global scale, 448 * 6 / amax (the same on every rank)
                gs.fill_(448.0 * 6.0 / float(unfused_norm.float().abs().max()))
            fused_out = fused_step()
            torch.cuda.synchronize(device)
            try:  # RuntimeError if a peer timed out or a route pointed past allreduce_in
                ws.check()
                failed = 0.0
            except RuntimeError as e:
                print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
                failed = 1.0
            if worst_over_ranks([failed], device)[0]:  # every rank stops together
                all_ok = False
                break
            errs = [rel_err(fused_out.residual_out, unfused_res), rel_err(fused_out.norm_out, unfused_norm)]
            if quant:
                deq = nvfp4_dequant(fused_out.quant_out, fused_out.scale_out, float(gs), T, args.hidden)
                errs.append(rel_err(deq, fused_out.norm_out))
            errs = worst_over_ranks(errs, device)
            ok = errs[0] <= tol and errs[1] <= tol and (not quant or errs[2] <= NVFP4_TOLERANCE)

            # timing: CUDA graph replays (the fused graph's outputs must equal the eager call's)
            t_fused, graph_out, fused_graph = graph_time_us(fused_step, args.calls, args.replays, args.warmup, device)
            t_unfused, _, unfused_graph = graph_time_us(lambda: unfused_tail(inputs, dist.group.WORLD), args.calls,
                                                        args.replays, args.warmup, device)
            same = torch.equal(graph_out.residual_out, fused_out.residual_out) and \
                torch.equal(graph_out.norm_out, fused_out.norm_out)
            same = worst_over_ranks([0.0 if same else 1.0], device)[0] == 0.0
            ok = ok and same
            all_ok &= ok
            del fused_graph, unfused_graph
            if rank == 0:
                nvfp4_err = f"{errs[2]:9.2e}" if quant else f"{'-':>9}"
                why = [what for what, bad in (("residual_out", errs[0] > tol), ("norm_out", errs[1] > tol),
                                        ("nvfp4", quant and errs[2] > NVFP4_TOLERANCE),
                                        ("replayed graph != eager call", not same)) if bad]
                why = f" ({', '.join(why)})" if why else ""
                print(f"{T:>7} {program:<26} {t_fused:>9.1f} {t_unfused:>10.1f} {t_unfused / t_fused:>6.2f}x "
                      f"{errs[0]:9.2e} {errs[1]:9.2e} {nvfp4_err}  {'ok' if ok else 'FAILED'}{why}", flush=True)
    finally:
        torch.cuda.synchronize(device)
        ws.close()
    return all_ok


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(REQUIRED_ENV)  # before NCCL / symmetric memory / NVSHMEM initialize
    import torch
    import torch.distributed as dist
    if "LOCAL_RANK" not in os.environ:
        print("run with torchrun, e.g.: torchrun --nproc-per-node 2 examples/moe_tail.py", file=sys.stderr)
        return 2
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        ok = run(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
