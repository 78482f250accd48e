"""Runtime of the MoE finalize + all-reduce + residual + RMSNorm (+ NVFP4) programs.

    ws = dispatch.Workspace(group, max_tokens, hidden, torch.bfloat16)
    ws = dispatch.LocalWorkspace(max_tokens, hidden, torch.bfloat16)     # world size 1, no group
    out = dispatch.moe_finalize_allreduce(ws, allreduce_in=..., expanded_idx_to_permuted_idx=...,
                                          residual_in=..., norm_weight=..., ...)

Reads only the committed, verified generated/ tree; see README.md and op.moe_finalize_allreduce.
"""
from .op import MoeFinalizeOutputs, moe_finalize_allreduce, scale_out_bytes, select_program
from .registry import program_info, programs, warmup
from .table_sets import selection_info
from .workspace import Workspace, check
from .emulated_world import EmulatedWorld
from .local import LocalWorkspace
from .torch_op import moe_finalize_allreduce_op, workspace_from_handle, workspace_handle  # registers moe_ar::
from .flashinfer_compat import trtllm_moe_finalize_allreduce_fusion


def gpu_available() -> bool:
    """True when torch sees a CUDA GPU (the programs need one to run)."""
    import torch
    return torch.cuda.is_available()


__all__ = ["EmulatedWorld", "LocalWorkspace", "MoeFinalizeOutputs", "Workspace", "check", "gpu_available",
           "moe_finalize_allreduce", "moe_finalize_allreduce_op", "program_info", "programs", "scale_out_bytes",
           "select_program", "selection_info", "trtllm_moe_finalize_allreduce_fusion", "warmup",
           "workspace_from_handle", "workspace_handle"]
