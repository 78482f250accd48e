"""Kernels for Nsight Compute: plain against NVFP4 (and FP8 group-128) at 1, 128 and 1,024 tokens,
H 7168, top_k 8 + shared, bf16, the automatic choice (the cluster layout at 1, the latency program at
128, the streaming program at 1,024). Each launched twice on one input set; the outputs are allocated
by the call.

    ncu --clock-control none --cache-control all -k regex:'^moe_ar' --set full --import-source no \
        -o DIR/report python experiments/world_size_1/nvfp4_cost/ncu_probe.py
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import dispatch  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "mid_tokens_ncu_probe", pathlib.Path(__file__).resolve().parent.parent / "mid_tokens" / "ncu_probe.py")
mid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mid)  # its inputs(T): the same rows, routes and weights
DT, RSF, EPS, H = mid.DT, mid.RSF, mid.EPS, mid.H
NAMES = {"allreduce_in": "allreduce_in", "idx": "expanded_idx_to_permuted_idx", "scale": "expert_scale_factor",
         "residual": "residual_in", "shared": "shared_expert_output", "gamma": "norm_weight"}


def inputs(T):
    return {NAMES[k]: v for k, v in mid.inputs(T).items()}


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
