"""Kernels for Nsight Compute: plain against NVFP4 (and FP8 group-128) at 1, 128 and 1,024 tokens,
H 7168, top_k 8 + shared, bf16, the automatic choice (the cluster layout at 1, the latency program at
128, the streaming program at 1,024). Each launched twice on one input set; the outputs are allocated
by the call.

    ncu --clock-control none --cache-control all -k regex:'^moe_ar' --set full --import-source no \
        -o DIR/report python experiments/world_size_1/nvfp4_cost/ncu_probe.py
"""
from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import dispatch  # noqa: E402

DT, RSF, EPS, H, K = torch.bfloat16, 2.5, 1e-6, 7168, 8


def inputs(T):
    g = torch.Generator(device="cuda")
    g.manual_seed(T)
    x = 0.5 * torch.randn(T * K, H, generator=g, device="cuda", dtype=DT)
    idx = torch.argsort(torch.rand(T * K, generator=g, device="cuda")).view(T, K).to(torch.int32)
    sc = torch.rand(T, K, generator=g, device="cuda") + 0.05
    return dict(allreduce_in=x, expanded_idx_to_permuted_idx=idx, expert_scale_factor=sc / sc.sum(-1, keepdim=True),
                residual_in=torch.randn(T, H, generator=g, device="cuda", dtype=DT),
                shared_expert_output=0.5 * torch.randn(T, H, generator=g, device="cuda", dtype=DT),
                norm_weight=(1 + 0.1 * torch.randn(H, generator=g, device="cuda")).to(DT))


def main():
    gs = torch.tensor([448.0 * 6.0 / 4.0], device="cuda")
    for T in (1, 128, 1024):
        x = inputs(T)
        ws = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=DT)
        for quant in (None, "nvfp4", "fp8_group128"):
            extra = {"global_scale": gs} if quant == "nvfp4" else {}
            for _ in range(2):
                dispatch.moe_finalize_allreduce(ws, **x, routed_scaling_factor=RSF, eps=EPS, quant=quant, **extra)
            torch.cuda.synchronize()
            print(f"T {T} {quant}: launched twice", flush=True)
        ws.close()


if __name__ == "__main__":
    main()
