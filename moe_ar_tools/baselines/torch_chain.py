"""The world-size-1 step written with torch ops, the way an engine without our kernel writes it:
gather the expert rows, weight and sum them (moe_ar_tools.bench.torch_ops.finalize_into), add the
shared expert and the residual, torch's rms_norm, then the quantization in torch (NVFP4 with 128x4
swizzled scales, FP8 per-token-group-128 with row- or column-major scales, FP8 per-tensor).

Every function takes and returns tensors only (the output format as Python constants), allocates
its outputs and works on CPU tensors too, so that torch.compile traces it as is and the CPU tests
check it against the float64 reference."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from moe_ar_tools.bench.torch_ops import finalize_into
from moe_ar_tools.reference import E4M3_MAX, FP8_EPS, e2m1_nibbles

NVFP4_BLOCK = 16
FP8_GROUP = 128
E2M1_MAX = 6.0


def finalize(allreduce_in, idx, scale, shared) -> torch.Tensor:
    """[T, H] partial = rsf * sum_k scale[t, k] * allreduce_in[idx[t, k]] + shared, in the dtype."""
    partial = torch.empty(idx.shape[0], allreduce_in.shape[1], dtype=allreduce_in.dtype,
                          device=allreduce_in.device)
    finalize_into(partial, allreduce_in, idx, scale, shared)
    return partial


def swizzle_128x4(block_scales: torch.Tensor) -> torch.Tensor:
    """uint8 [T, H/16] block scales -> the 1-D 128x4 swizzled layout (rows padded to 128, columns
    to 4, padding 0): tile [m/128][k/4], inside it [m%32][(m%128)/32][k%4]."""
    T, G = block_scales.shape
    rows, cols = -(-T // 128) * 128, -(-G // 4) * 4
    padded = F.pad(block_scales, (0, cols - G, 0, rows - T))
    return padded.view(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def nvfp4_quant(norm_out: torch.Tensor, global_scale: torch.Tensor) -> tuple:
    """(quant_out [T, H/2] uint8, scale_out 1-D uint8 swizzled): E2M1 pairs (element 2i in the low
    nibble) with one E4M3 scale per 16 elements, sf = gs * amax / 6; global_scale a [1] fp32 tensor."""
    T, H = norm_out.shape
    x = norm_out.float().view(T, H // NVFP4_BLOCK, NVFP4_BLOCK)
    sf = global_scale * x.abs().amax(-1) / E2M1_MAX
    sf8 = sf.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf8f = sf8.float()
    inv = torch.where(sf8f > 0, 1.0 / (sf8f / global_scale), torch.zeros_like(sf8f))
    nibbles = e2m1_nibbles(x * inv.unsqueeze(-1)).view(T, H)
    quant = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return quant, swizzle_128x4(sf8.view(torch.uint8))


def fp8_group_quant(norm_out: torch.Tensor, column_major: bool) -> tuple:
    """(quant_out [T, H] e4m3, scales): s = max(amax of 128 elements, 1e-10) / 448, q = e4m3(x / s);
    scales [T, H/128] row-major, or column-major [H/128, roundup(T, 4)] with the padding 0."""
    T, H = norm_out.shape
    x = norm_out.float().view(T, H // FP8_GROUP, FP8_GROUP)
    s = x.abs().amax(-1).clamp(min=FP8_EPS) / E4M3_MAX
    quant = (x / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(T, H)
    if column_major:
        s = F.pad(s.t(), (0, -(-T // 4) * 4 - T)).contiguous()
    return quant, s


def fp8_tensor_quant(norm_out: torch.Tensor, fp8_scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(x / fp8_scale, -448, 448)), fp8_scale a [1] fp32 tensor."""
    return (norm_out.float() / fp8_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def chain(allreduce_in, idx, scale, shared, residual_in, norm_weight, eps: float, quant: Optional[str],
          column_major: bool = False, global_scale=None, fp8_scale=None) -> dict:
    """The whole step: {"residual_out", "norm_out"} plus "quant_out" (and "scale_out") for `quant`
    ("nvfp4", "fp8_group128", "fp8_tensor" or None, as dispatch's `quant`)."""
    residual_out = finalize(allreduce_in, idx, scale, shared) + residual_in
    norm_out = F.rms_norm(residual_out, (residual_out.shape[-1],), norm_weight, eps)
    out = {"residual_out": residual_out, "norm_out": norm_out}
    if quant == "nvfp4":
        out["quant_out"], out["scale_out"] = nvfp4_quant(norm_out, global_scale)
    elif quant == "fp8_group128":
        out["quant_out"], out["scale_out"] = fp8_group_quant(norm_out, column_major)
    elif quant == "fp8_tensor":
        out["quant_out"] = fp8_tensor_quant(norm_out, fp8_scale)
    elif quant is not None:
        raise ValueError(f"quant: {quant!r}, expected None, 'nvfp4', 'fp8_group128' or 'fp8_tensor'")
    return out


COMPILE_MODES = ("dynamic", "static")


def compiled(mode: str) -> dict:
    """{"chain", "finalize"} under torch.compile (inductor, fullgraph): mode "dynamic" compiles once for
    every token count (dynamic shapes), "static" once per shape, as an engine that captures fixed
    sizes does. Each mode enters through its own function so that the two never share Dynamo's
    per-code-object cache (a dynamic entry would otherwise serve the static wrapper), and the
    recompile limits are raised to hold a whole sweep (hitting one would fall back to eager)."""
    import torch._dynamo.config as dynamo_config
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode: {mode!r}, expected one of {', '.join(COMPILE_MODES)}")
    for name, least in (("recompile_limit", 4096), ("cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 65536), ("accumulated_cache_size_limit", 65536)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), least))

    def chain_dynamic(*args, **kwargs):
        return chain(*args, **kwargs)

    def chain_static(*args, **kwargs):
        return chain(*args, **kwargs)

    def finalize_dynamic(*args):
        return finalize(*args)

    def finalize_static(*args):
        return finalize(*args)

    fns = {"dynamic": (chain_dynamic, finalize_dynamic), "static": (chain_static, finalize_static)}[mode]
    return {name: torch.compile(fn, backend="inductor", fullgraph=True, dynamic=mode == "dynamic")
            for name, fn in zip(("chain", "finalize"), fns)}
