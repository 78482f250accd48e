"""Dtypes and rounding: the formats' unit roundoffs and subnormal spacings, Higham's gamma, and the
correctly rounded float64 -> dtype conversion (one rounding: round to odd at float32 first)."""
from __future__ import annotations

import math

import torch


NAME_TO_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_TO_NAME = {v: k for k, v in NAME_TO_DTYPE.items()}
_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16"}

U32 = 2.0 ** -24  # unit roundoff of float32
# Unit roundoff u (half the spacing at 1.0) of each format: RN error <= u * |x|.
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: U32}
# Smallest subnormal spacing: absolute RN error <= half of it near zero.
SUBNORMAL_SPACING = {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133, torch.float32: 2.0 ** -149}


def as_torch_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    name = str(d).replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    return NAME_TO_DTYPE[name]


def dtype_name(d) -> str:
    return DTYPE_TO_NAME[as_torch_dtype(d)]


def f32(x) -> float:
    """A python number rounded to float32 (the kernel takes eps, rsf, gs as fp32)."""
    return float(torch.tensor(float(x), dtype=torch.float32))


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of n roundings."""
    return n * u / (1.0 - n * u)


def round_to_dtype(x: torch.Tensor, dtype) -> torch.Tensor:
    """Correctly rounded (RNE) float64 -> dtype, one rounding.

    float64 -> float32 with round-to-odd, then float32 -> dtype with RNE. Round to
    odd keeps a sticky bit, so the second rounding equals the direct one whenever
    the intermediate has at least p + 2 bits (24 >= 11 + 2).
    """
    dtype = dtype if isinstance(dtype, torch.dtype) else as_torch_dtype(dtype)
    x = x.to(torch.float64)
    if dtype == torch.float64:
        return x
    f = x.to(torch.float32)
    if dtype == torch.float32:
        return f
    back = f.to(torch.float64)
    inexact = back != x  # NaN: False (NaN stays NaN)
    even = (f.view(torch.int32) & 1) == 0
    fix = inexact & even & torch.isfinite(f)
    toward = torch.where(x > back, torch.full_like(f, math.inf), torch.full_like(f, -math.inf))
    f = torch.where(fix, torch.nextafter(f, toward), f)
    return f.to(dtype)
