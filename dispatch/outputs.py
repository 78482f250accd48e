"""A call's outputs: their shapes (the NVFP4 scale buffer, the FP8 group scales), the tuple a call
returns, and the outputs a call did not pass, taken from torch's caching allocator."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

FP8_GROUP = 128


class MoeFinalizeOutputs(NamedTuple):
    norm_out: torch.Tensor
    residual_out: torch.Tensor
    quant_out: Optional[torch.Tensor]
    scale_out: Optional[torch.Tensor]


def scale_out_bytes(tokens: int, hidden: int) -> int:
    """Bytes of the swizzled NVFP4 scale buffer: rows padded to 128, scale columns to 4."""
    return -(-tokens // 128) * 128 * (-(-(hidden // 16) // 4) * 4)


def fp8_scale_shape(tokens: int, hidden: int, layout: str = "row") -> tuple:
    """Shape of the float32 fp8_group128 scales: [T, H/128] ("row"), or [H/128, roundup(T, 4)]
    ("column": column-major and TMA-aligned as DeepGEMM-style consumers read it; `.t()[:T]` is the
    [T, H/128] view)."""
    groups = hidden // FP8_GROUP
    return (tokens, groups) if layout == "row" else (groups, -(-tokens // 4) * 4)


def allocate_outputs(ws, kwargs: dict) -> dict:
    """Fill in the output tensors the call did not pass, from torch's caching allocator (prepare_call,
    so before EmulatedWorld.run forks its streams)."""
    T = kwargs["expanded_idx_to_permuted_idx"].shape[0]
    H = ws.hidden
    if kwargs.get("norm_out") is None:
        kwargs["norm_out"] = torch.empty((T, H), dtype=ws.dtype, device=ws.device)
    if kwargs.get("residual_out") is None:
        kwargs["residual_out"] = torch.empty((T, H), dtype=ws.dtype, device=ws.device)
    quant = kwargs.get("quant")
    if quant == "nvfp4":
        if kwargs.get("quant_out") is None:
            kwargs["quant_out"] = torch.empty((T, H // 2), dtype=torch.uint8, device=ws.device)
        if kwargs.get("scale_out") is None:
            kwargs["scale_out"] = torch.empty((scale_out_bytes(T, H),), dtype=torch.uint8, device=ws.device)
    if quant in ("fp8_group128", "fp8_tensor") and kwargs.get("quant_out") is None:
        kwargs["quant_out"] = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=ws.device)
    if quant == "fp8_group128" and kwargs.get("scale_out") is None:
        layout = kwargs.get("fp8_scale_layout", "row")
        kwargs["scale_out"] = torch.empty(fp8_scale_shape(T, H, layout), dtype=torch.float32, device=ws.device)
    return kwargs
