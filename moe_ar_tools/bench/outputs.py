"""The outputs a system writes at a point, one dict of tensors an input set (dispatch's out
arguments by profile), and their poison before a checked replay."""
from __future__ import annotations

from typing import Optional


def alloc_outputs(tokens: int, hidden: int, dtype, quant: Optional[str], device, scale_layout: str = "row") -> dict:
    """norm_out and residual_out [T, H], and quant_out and scale_out of the quantized profiles
    (`quant` as dispatch's quant=; FP8 group-128 scales in `scale_layout`)."""
    import torch
    from dispatch.op import fp8_scale_shape, scale_out_bytes
    outs = {"norm_out": torch.empty(tokens, hidden, dtype=dtype, device=device),
            "residual_out": torch.empty(tokens, hidden, dtype=dtype, device=device)}
    if quant == "nvfp4":
        outs["quant_out"] = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=device)
        outs["scale_out"] = torch.empty(scale_out_bytes(tokens, hidden), dtype=torch.uint8, device=device)
    elif quant is not None:
        outs["quant_out"] = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device)
    if quant == "fp8_group128":
        outs["scale_out"] = torch.empty(fp8_scale_shape(tokens, hidden, scale_layout), dtype=torch.float32,
                                        device=device)
    return outs


def alloc_output_sets(tokens: int, hidden: int, dtype, quant: Optional[str], n_sets: int, device) -> list:
    """alloc_outputs for each of `n_sets` input sets."""
    return [alloc_outputs(tokens, hidden, dtype, quant, device) for _ in range(n_sets)]


def poison(outputs: list) -> None:
    """NaN into float outputs, an E4M3 NaN into FP8 ones, 0xAB into byte outputs (the reference's
    poison) of each dict in `outputs`: a check then sees what was not written."""
    from moe_ar_tools import reference as ref
    for outs in outputs:
        ref.repoison(outs)
