"""Host time of one rank's eager call, split into its parts, beside torch.add in the same run.

    python -m moe_ar_tools.host_time --out bench_results/host_time/run.json    (one GPU)

The two ranks of an emulated world of 2 on one GPU each make the call in turn, on their own
streams (the kernels need both ranks); only the host time of each rank's own call is timed
(time.perf_counter_ns around it), never the stream switch between them. Per round, in an order
shuffled each round:

    call        dispatch.moe_finalize_allreduce on a rank's workspace, outputs given: the path a real
                process takes (the call matched against the workspace's last plan, launch)
    call_by_signature  the same with the recent plans forgotten first: the plan found by the call's
                signature (a workspace whose calls go round more signatures than it keeps recent)
    call_alternating  calls of 16 and of 8 tokens in turn: the plan matched among the recent ones
    checks      op.prepare_call alone (a plan exists: the per-call checks; nothing launched)
    first_call  every check of a call whose signature has no plan yet (op._full_checks)
    launch      the launch of a call already prepared (op.prepare_call outside the timing)
    empty_launch  an empty kernel through the same driver call (op's cuLaunchKernelEx), for scale
    custom_op   torch.ops.moe_ar.moe_finalize_allreduce (functional: allocates its outputs)
    custom_op_out  torch.ops.moe_ar.moe_finalize_allreduce_out (outputs given)
    torch_add   torch.add(x, y, out=z) on [T, H] bf16 tensors of the same GPU
    rms_norm    torch.nn.functional.rms_norm of [T, H] bf16

Medians over the rounds.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time

import torch

NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _inputs(T, K, H, rank, device, quant):
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    R = T * K
    kw = dict(allreduce_in=torch.randn(R, H, generator=g).to(torch.bfloat16).to(device),
              expanded_idx_to_permuted_idx=torch.randperm(R, generator=g).view(T, K).int().to(device),
              expert_scale_factor=torch.rand(T, K, generator=g).to(device),
              shared_expert_output=torch.randn(T, H, generator=g).to(torch.bfloat16).to(device),
              residual_in=torch.randn(T, H, generator=g).to(torch.bfloat16).to(device),
              norm_weight=torch.ones(H, dtype=torch.bfloat16, device=device),
              norm_out=torch.empty(T, H, dtype=torch.bfloat16, device=device),
              residual_out=torch.empty(T, H, dtype=torch.bfloat16, device=device))
    if quant == "nvfp4":
        from dispatch.op import scale_out_bytes
        kw.update(quant="nvfp4", global_scale=torch.tensor([448.0 * 6 / 4], device=device),
                  quant_out=torch.empty(T, H // 2, dtype=torch.uint8, device=device),
                  scale_out=torch.empty(scale_out_bytes(T, H), dtype=torch.uint8, device=device))
    return kw


def measure(tokens=16, hidden=7168, top_k=8, rounds=2000, quant=None, seed=0) -> dict:
    import os
    for k, v in NVLINK_MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    import dispatch
    from dispatch import launcher, op
    device = torch.device("cuda", torch.cuda.current_device())
    # One world for the direct calls, one for each custom op and one for the alternating calls: each
    # keeps its own signatures as its recent plans (the ops pass every option: other signatures).
    world, op_world, out_world, alt_world = (dispatch.EmulatedWorld(2, max_tokens=max(tokens, 16), hidden=hidden,
                                                                    dtype=torch.bfloat16) for _ in range(4))
    ranks = world.workspaces
    kws = [_inputs(tokens, top_k, hidden, r, device, quant) for r in range(2)]
    kws_half = [_inputs(max(tokens // 2, 1), top_k, hidden, r, device, quant) for r in range(2)]
    turn = [0, 0]
    handles = [dispatch.workspace_handle(w) for w in op_world.workspaces]
    out_handles = [dispatch.workspace_handle(w) for w in out_world.workspaces]
    op_inputs = [{k: v for k, v in kw.items() if k not in ("norm_out", "residual_out", "quant_out", "scale_out")}
                 for kw in kws]
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    y, z = torch.randn_like(x), torch.empty_like(x)
    weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)

    def both(fn, on=world):
        """fn(rank) on each rank's stream; the host ns of each rank's fn."""
        out = []
        for r in range(2):
            with torch.cuda.stream(on.streams[r]):
                t0 = time.perf_counter_ns()
                fn(r)
                out.append(time.perf_counter_ns() - t0)
        return out

    def call(r):
        dispatch.moe_finalize_allreduce(ranks[r], **kws[r])

    def call_alternating(r):
        turn[r] ^= 1
        dispatch.moe_finalize_allreduce(alt_world.workspaces[r], **(kws[r] if turn[r] else kws_half[r]))

    def call_by_signature(r):
        ranks[r]._moe_ar_state.recent_plans.clear()
        dispatch.moe_finalize_allreduce(ranks[r], **kws[r])

    def checks(r):
        op.prepare_call(ranks[r], dict(kws[r]))

    def first_call(r):
        op._full_checks(ranks[r], dict(kws[r]))  # what a new signature costs (its plan is not kept)

    prepared = [None, None]

    def prepare_both():
        for r in range(2):
            prepared[r] = op.prepare_call(ranks[r], dict(kws[r]))

    def launch(r):
        prepared[r].launch()

    import cupy
    empty = cupy.RawKernel('extern "C" __global__ void moe_ar_empty() {}', "moe_ar_empty")
    empty_ptr = empty.kernel.ptr
    empty_config = launcher._LaunchConfig(1, 1, 1, 32, 1, 1, 0, None, None, 0)

    def empty_launch():
        empty_config.hStream = launcher._current_stream(device.index)
        err = launcher._cu_launch_kernel_ex(ctypes.byref(empty_config), empty_ptr, None, None)
        assert err == 0, err

    def custom_op(r):
        torch.ops.moe_ar.moe_finalize_allreduce(
            handles[r], op_inputs[r]["allreduce_in"], op_inputs[r]["expanded_idx_to_permuted_idx"],
            op_inputs[r]["residual_in"], op_inputs[r]["norm_weight"],
            expert_scale_factor=op_inputs[r]["expert_scale_factor"],
            shared_expert_output=op_inputs[r]["shared_expert_output"], quant=quant,
            global_scale=op_inputs[r].get("global_scale"))

    def custom_op_out(r):
        kw = kws[r]
        torch.ops.moe_ar.moe_finalize_allreduce_out(
            out_handles[r], kw["allreduce_in"], kw["expanded_idx_to_permuted_idx"], kw["residual_in"], kw["norm_weight"],
            kw["norm_out"], kw["residual_out"], kw.get("quant_out"), kw.get("scale_out"),
            expert_scale_factor=kw["expert_scale_factor"], shared_expert_output=kw["shared_expert_output"],
            quant=quant, global_scale=kw.get("global_scale"))

    def timed_single(fn):
        t0 = time.perf_counter_ns()
        fn()
        return [time.perf_counter_ns() - t0]

    systems = {
        "call": lambda: both(call),
        "call_by_signature": lambda: both(call_by_signature),
        "call_alternating": lambda: both(call_alternating, alt_world),
        "checks": lambda: both(checks),
        "launch": lambda: (prepare_both(), both(launch))[1],
        "empty_launch": lambda: timed_single(empty_launch),
        "first_call": lambda: both(first_call),
        "custom_op": lambda: both(custom_op, op_world),
        "custom_op_out": lambda: both(custom_op_out, out_world),
        "torch_add": lambda: timed_single(lambda: torch.add(x, y, out=z)),
        "rms_norm": lambda: timed_single(lambda: torch.nn.functional.rms_norm(x, (hidden,), weight, 1e-6)),
    }
    for _ in range(20):  # warm-up: programs compiled and loaded, plans built
        for fn in systems.values():
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in systems}
    rnd = random.Random(seed)
    order = list(systems)
    for i in range(rounds):
        rnd.shuffle(order)
        for name in order:
            samples[name].extend(systems[name]())
        if i % 50 == 49:
            torch.cuda.synchronize()  # outside any timed region: keeps the launch queue short
    torch.cuda.synchronize()
    dispatch.check()
    for w in (world, op_world, out_world, alt_world):
        w.close()
    med = {name: statistics.median(v) / 1e3 for name, v in samples.items()}
    return {"tokens": tokens, "hidden": hidden, "top_k": top_k, "quant": quant, "rounds": rounds,
            "median_us": med, "ratio_to_torch_add": {k: v / med["torch_add"] for k, v in med.items()},
            "samples_per_system": {k: len(v) for k, v in samples.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from moe_ar_tools.provenance import git_commit
    from moe_ar_tools.soak.result import machine_info
    results = {"commit": git_commit(), "machine": machine_info(), "runs": [measure(args.tokens, rounds=args.rounds, quant=q)
                                                   for q in (None, "nvfp4")]}
    for run in results["runs"]:
        print(f"\nquant={run['quant']}, {run['tokens']} tokens, H {run['hidden']}: median host us (x torch.add)")
        print("| part | us | / torch.add |\n|---|---:|---:|")
        for k, v in run["median_us"].items():
            print(f"| {k} | {v:.1f} | {run['ratio_to_torch_add'][k]:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
