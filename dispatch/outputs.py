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


def _values_nvfp4(tokens, hidden, layout):
    return tokens, hidden // 2  # E2M1 pairs


def _scales_nvfp4(tokens, hidden, layout):
    return (scale_out_bytes(tokens, hidden),)


def _values_fp8(tokens, hidden, layout):
    return tokens, hidden


def _scales_fp8_group(tokens, hidden, layout):
    return fp8_scale_shape(tokens, hidden, layout)


QUANT_OUTPUT_NAMES = ("quant_out", "scale_out")
# What each quant writes besides norm_out and residual_out ([T, H] D): for quant_out, then scale_out, (dtype,
# shape of (tokens, hidden, fp8_scale_layout)), the shape None where the quant writes none; the torch op then
# returns an empty (0,) tensor of that dtype in its place. Argument checks, allocation and the op's fake read it.
QUANT_OUTPUTS = {
    None: ((torch.uint8, None), (torch.uint8, None)),
    "nvfp4": ((torch.uint8, _values_nvfp4), (torch.uint8, _scales_nvfp4)),
    "fp8_group128": ((torch.float8_e4m3fn, _values_fp8), (torch.float32, _scales_fp8_group)),
    "fp8_tensor": ((torch.float8_e4m3fn, _values_fp8), (torch.float32, None)),
}
# (name, dtype, shape) of each output a quant writes, for the allocation on the call path
_WRITTEN = {quant: tuple((name, dtype, shape) for name, (dtype, shape) in zip(QUANT_OUTPUT_NAMES, outs)
                         if shape is not None)
            for quant, outs in QUANT_OUTPUTS.items()}


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
    if quant is not None:
        layout = kwargs.get("fp8_scale_layout", "row")
        for name, dtype, shape in _WRITTEN[quant]:
            if kwargs.get(name) is None:
                kwargs[name] = torch.empty(shape(T, H, layout), dtype=dtype, device=ws.device)
    return kwargs
