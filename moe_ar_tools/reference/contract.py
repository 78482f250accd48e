"""The op in float64 (docs/operation.md's precision contract: each rank's partial rounded once to
the dtype, the sum in float64, one rounding to residual_out, RMSNorm in float64), and the bounds of
what a float32-accumulating kernel may produce (residual and norm brackets)."""
from __future__ import annotations

import torch

from moe_ar_tools.reference.rounding import U32, as_torch_dtype, f32, gamma, round_to_dtype


def _partial_and_magnitude(allreduce_in, idx, scale, rsf, shared):
    """(partial, magnitude): float64 [T, H]

    partial = rsf * sum_k scale[t,k] * allreduce_in[idx[t,k]] (skip idx < 0) + shared
    magnitude = |rsf| * sum_k |scale * row| + |shared|  (for error bounds)
    """
    dev = allreduce_in.device
    idx = idx.to(dev).long()
    T, K = idx.shape
    H = allreduce_in.shape[1]
    acc = torch.zeros(T, H, dtype=torch.float64, device=dev)
    mag = torch.zeros(T, H, dtype=torch.float64, device=dev)
    ones = torch.ones(T, dtype=torch.float64, device=dev)
    for k in range(K):
        col = idx[:, k]
        valid = (col >= 0)[:, None]
        rows = allreduce_in.index_select(0, col.clamp(min=0)).to(torch.float64)
        w = scale[:, k].to(dev).to(torch.float64) if scale is not None else ones
        # where(), not a multiply by 0: unreferenced rows may hold NaN on purpose.
        term = torch.where(valid, w[:, None] * rows, torch.zeros((), dtype=torch.float64, device=dev))
        acc += term
        mag += term.abs()
    r = f32(rsf)
    acc *= r
    mag *= abs(r)
    if shared is not None:
        s = shared.to(dev).to(torch.float64)
        acc += s
        mag += s.abs()
    return acc, mag


def finalize_partial(allreduce_in, idx, scale, rsf, shared) -> torch.Tensor:
    """rsf * sum_k scale[t,k] * allreduce_in[idx[t,k]] (skip idx < 0) + shared, float64 [T, H]."""
    return _partial_and_magnitude(allreduce_in, idx, scale, rsf, shared)[0]


def rmsnorm_f64(residual, norm_weight, eps, weight_bias) -> torch.Tensor:
    """float64 x * 1/sqrt(mean(x^2) + eps) * (gamma + weight_bias); eps taken as fp32."""
    x = residual.to(torch.float64)
    ms = (x * x).mean(-1, keepdim=True)
    inv = 1.0 / torch.sqrt(ms + f32(eps))
    g = norm_weight.to(x.device).to(torch.float64) + float(weight_bias)
    return x * inv * g


def reference(per_rank, eps, weight_bias, routed_scaling_factor, dtype) -> dict:
    """The precision contract, in float64 with single roundings to dtype.

    Returns (all on rank 0'total device):
      residual_out, norm_out: dtype tensors (the contract'total results)
      residual_out_f64: float64 sum of the rounded partials + residual_in, before rounding
      norm_out_f64: float64 RMSNorm of residual_out, before rounding
      partials: list of per-rank partials rounded to dtype (world size 1: the float64 partial)
      residual_lo, residual_hi: dtype bounds of what a float32-accumulating kernel
        may legally produce for residual_out (see residual_bracket)
    """
    if len(per_rank) == 1:
        return _reference_world_one(per_rank[0], eps, weight_bias, routed_scaling_factor, dtype)
    dtype = as_torch_dtype(dtype)
    device = per_rank[0]["allreduce_in"].device
    W = len(per_rank)
    K = per_rank[0]["expanded_idx_to_permuted_idx"].shape[1]
    residual_in = per_rank[0]["residual_in"].to(device)  # replicated across ranks
    norm_weight = per_rank[0]["norm_weight"].to(device)
    res64 = residual_in.to(torch.float64)

    n_partial = K + 4  # K products, K-1 adds, rsf multiply, shared add, one spare
    total = res64.clone()
    total_lo = res64.clone()
    total_hi = res64.clone()
    absum = res64.abs()
    partials = []
    for inputs in per_rank:
        partial, magnitude = _partial_and_magnitude(
            inputs["allreduce_in"].to(device), inputs["expanded_idx_to_permuted_idx"],
            inputs.get("expert_scale_factor"), routed_scaling_factor, inputs.get("shared_expert_output"))
        rounded = round_to_dtype(partial, dtype)
        partials.append(rounded)
        total += rounded.to(torch.float64)
        # float32 accumulation error bound, plus a float64 margin for the partial itself
        err = (gamma(n_partial) + 2.0 ** -50) * magnitude
        lo = round_to_dtype(partial - err, dtype).to(torch.float64)
        hi = round_to_dtype(partial + err, dtype).to(torch.float64)
        total_lo += lo
        total_hi += hi
        absum += torch.maximum(lo.abs(), hi.abs())
    sum_err = gamma(W + 1) * absum  # W+1 dtype values summed in float32, any order
    residual_out = round_to_dtype(total, dtype)
    norm64 = rmsnorm_f64(residual_out, norm_weight, eps, weight_bias)
    return dict(
        residual_out=residual_out,
        norm_out=round_to_dtype(norm64, dtype),
        residual_out_f64=total,
        norm_out_f64=norm64,
        partials=partials,
        residual_lo=round_to_dtype(total_lo - sum_err, dtype),
        residual_hi=round_to_dtype(total_hi + sum_err, dtype),
    )


def _reference_world_one(inputs, eps, weight_bias, routed_scaling_factor, dtype) -> dict:
    """reference() at world size 1 (docs/operation.md, "World size 1"): nothing travels, so the
    partial is not rounded; residual_out = D(partial + residual_in), rounded once. The kernel's float32
    partial and its residual add take at most K + 5 roundings (one spare) of values within
    m + |residual_in| (m as in RESIDUAL_BRACKET_DOC), which bounds residual_out's bracket."""
    dtype = as_torch_dtype(dtype)
    device = inputs["allreduce_in"].device
    K = inputs["expanded_idx_to_permuted_idx"].shape[1]
    res64 = inputs["residual_in"].to(device).to(torch.float64)
    partial, magnitude = _partial_and_magnitude(
        inputs["allreduce_in"], inputs["expanded_idx_to_permuted_idx"], inputs.get("expert_scale_factor"),
        routed_scaling_factor, inputs.get("shared_expert_output"))
    total = res64 + partial
    err = (gamma(K + 5) + 2.0 ** -50) * (magnitude + res64.abs())
    residual_out = round_to_dtype(total, dtype)
    norm64 = rmsnorm_f64(residual_out, inputs["norm_weight"].to(device), eps, weight_bias)
    return dict(residual_out=residual_out, norm_out=round_to_dtype(norm64, dtype), residual_out_f64=total,
                norm_out_f64=norm64, partials=[partial], residual_lo=round_to_dtype(total - err, dtype),
                residual_hi=round_to_dtype(total + err, dtype))


RESIDUAL_BRACKET_DOC = """
residual_out bracket. The kernel computes rank r's partial in float32: at most
K + 4 roundings (products, adds, rsf, shared add), so its float32 value y_r is
within gamma(K+4) * m_r of the exact partial x_r, with m_r = |rsf| sum|scale*row|
+ |shared|. It rounds y_r to D; RN is monotone, so the partial it sends lies in
[D(x_r - e_r), D(x_r + e_r)]; that interval is the single value D(x_r) unless x_r
is within e_r of a rounding boundary of D. The W partials and residual_in
(all D values, exact in float32) are summed in float32 in some order: error <=
gamma(W+1) * sum|terms|. Rounding once to D (monotone) gives
residual_out in [D(sum lo_r + res - e_s), D(sum hi_r + res + e_s)].
"""


def norm_rel_bound(hidden: int) -> float:
    """Relative error bound of a float32 RMSNorm evaluation, before rounding to D.

    x^2 of a D value is exact in float32 (<= 22 significant bits). Sum of H
    non-negative terms, any order: gamma(H-1); 1/H (rounded), the multiply or
    divide by H, and the eps add: 3 more roundings -> mean square within
    gamma(H+2); the square root halves a relative error (x1.01 for the second-order
    term). rsqrtf: at most 2 ulp (CUDA math docs) = 4u; x * r, (gamma +
    weight_bias), * g: 3u; 1u spare.
    """
    return 0.5 * 1.01 * gamma(hidden + 2) + 8 * U32


def norm_bracket(residual_out, norm_weight, eps, weight_bias, dtype):
    """(y64, lo, hi): what norm_out may be, given this residual_out (a kernel's own)."""
    dtype = as_torch_dtype(dtype)
    y = rmsnorm_f64(residual_out, norm_weight, eps, weight_bias)
    d = norm_rel_bound(residual_out.shape[-1]) * y.abs()
    return y, round_to_dtype(y - d, dtype), round_to_dtype(y + d, dtype)
