"""Runtime of the MoE finalize + all-reduce + residual + RMSNorm (+ NVFP4) programs.

    ws = dispatch.Workspace(group, max_tokens, hidden, torch.bfloat16)
    out = dispatch.moe_finalize_allreduce(ws, allreduce_in=..., expanded_idx_to_permuted_idx=...,
                                          residual_in=..., norm_weight=..., ...)

Reads only the committed, verified generated/ tree; see README.md and op.moe_finalize_allreduce.
"""
from .op import MoeFinalizeOutputs, moe_finalize_allreduce, scale_out_bytes, select_program
from .registry import program_info, programs, warmup
from .workspace import EmulatedWorld, Workspace, check


def gpu_available() -> bool:
    """True when torch sees a CUDA GPU (the programs need one to run)."""
    import torch
    return torch.cuda.is_available()


__all__ = ["EmulatedWorld", "MoeFinalizeOutputs", "Workspace", "check", "gpu_available", "moe_finalize_allreduce",
           "program_info", "programs", "scale_out_bytes", "select_program", "warmup"]
