"""Kernels for Nsight Compute at 128 and 2,048 tokens (H 7168, top_k 8 + shared, bf16, plain): the
latency program (one block a token, and its cluster layout forced to 128 tokens), the streaming
program, and the Triton kernel at num_warps 8 and 16. Each system launched twice on one input set.

    ncu --clock-control none --cache-control all -k regex:'^(fused|moe_ar)' --set full -o DIR/report \
        python experiments/world_size_1/mid_tokens/ncu_probe.py
"""
from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import dispatch  # noqa: E402
from dispatch import registry  # noqa: E402
from moe_ar_tools.baselines import triton_fused as tf  # noqa: E402

DT, RSF, EPS, H, K = torch.bfloat16, 2.5, 1e-6, 7168, 8


def inputs(T, seed=None):
    g = torch.Generator(device="cuda")
    g.manual_seed(T if seed is None else seed)
    x = 0.5 * torch.randn(T * K, H, generator=g, device="cuda", dtype=DT)
    idx = torch.argsort(torch.rand(T * K, generator=g, device="cuda")).view(T, K).to(torch.int32)
    sc = torch.rand(T, K, generator=g, device="cuda") + 0.05
    return dict(allreduce_in=x, idx=idx, scale=sc / sc.sum(-1, keepdim=True),
                residual=torch.randn(T, H, generator=g, device="cuda", dtype=DT),
                shared=0.5 * torch.randn(T, H, generator=g, device="cuda", dtype=DT),
                gamma=(1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(DT))


def main():
    limits = registry.program_set().limits
    for T in (128, 2048):
        x = inputs(T)
        o = {"residual_out": torch.empty(T, H, dtype=DT, device="cuda"),
             "norm_out": torch.empty(T, H, dtype=DT, device="cuda")}
        ws = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=DT)

        def ours(family):
            dispatch.moe_finalize_allreduce(
                ws, allreduce_in=x["allreduce_in"], expanded_idx_to_permuted_idx=x["idx"], residual_in=x["residual"],
                norm_weight=x["gamma"], expert_scale_factor=x["scale"], routed_scaling_factor=RSF,
                shared_expert_output=x["shared"], eps=EPS, program=f"moe_ar_{family}_bf16_ws1_plain", **o)

        systems = [("lc", lambda: ours("local")), ("lcs", lambda: ours("local_streaming"))]  # the recorded labels
        for nw in (8, 16):
            systems.append((f"triton_nw{nw}", lambda nw=nw: tf.fused(
                o, x["allreduce_in"], x["idx"], x["scale"], x["shared"], x["residual"], x["gamma"], eps=EPS,
                routed_scaling_factor=RSF, num_warps=nw)))
        for name, fn in systems:
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            print(f"T {T} {name}: launched twice", flush=True)
        if T == 128:  # the cluster layout at 128 tokens (a fresh workspace: the launcher reads the limit)
            saved = limits["cluster_max_tokens"]
            limits["cluster_max_tokens"] = 128
            ws2 = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=DT)
            for _ in range(2):
                dispatch.moe_finalize_allreduce(
                    ws2, allreduce_in=x["allreduce_in"], expanded_idx_to_permuted_idx=x["idx"],
                    residual_in=x["residual"], norm_weight=x["gamma"], expert_scale_factor=x["scale"],
                    routed_scaling_factor=RSF, shared_expert_output=x["shared"], eps=EPS,
                    program="moe_ar_local_bf16_ws1_plain", **o)
            torch.cuda.synchronize()
            print(f"T {T} lc cluster: launched twice", flush=True)
            limits["cluster_max_tokens"] = saved
            ws2.close()
        ws.close()


if __name__ == "__main__":
    main()
