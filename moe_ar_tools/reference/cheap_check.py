"""Per-element expectations and tolerances for a cheap check on the device (the soak's):
check_outputs is exact but slow (brackets by rounding, on the host); these give, on the device
and for every element, an expected value and a distance a correct kernel stays within."""
from __future__ import annotations

import torch

from moe_ar_tools.reference.contract import norm_rel_bound, rmsnorm_f64
from moe_ar_tools.reference.rounding import SUBNORMAL_SPACING, UNIT_ROUNDOFF, f32, gamma


def residual_expectation(allreduce_in_by_rank: torch.Tensor, route_rows: torch.Tensor, tokens: int, top_k: int,
                         scale, rsf: float, shared, residual_in: torch.Tensor, dtype: torch.dtype):
    """(S, tol), float64 [T, H]: what residual_out must be, and how far a correct kernel may be from it.

    allreduce_in_by_rank: [W, rows, H] dtype, every rank's allreduce_in stacked (one row of zeros
    stands for dropped routes); route_rows: [T*K] int64 row of each (token, route), dropped routes
    pointing at the zero row; scale: [T*K] float32 or dtype, or None; shared: [W, T, H] dtype or None
    (zeros for a rank without one); residual_in: [T, H] dtype. Works on CPU and CUDA tensors.

    Each rank's partial is recomputed in float32 (K + 4 roundings at most, as the kernel's) and
    rounded to dtype: q'_r. S = sum_r q'_r + residual_in in float64. A contract-following kernel's
    rounded partial q_r differs from q'_r by at most d_r = 2.01 u |q'_r| + 1.01 * 2 gamma(K+4) m_r +
    3 eta (m_r = |rsf| sum_k |s x| + |shared|: the two float32 values are within 2 gamma(K+4) m_r and
    may round to neighbouring dtype values); its float32 sum of W + 1 terms errs by gamma(W+1) of
    their magnitudes and the final rounding by u |.| + eta. Hence
        tol = (1 + u) (D + gamma(W+1) (A + D)) + u |S| + 2^-45 A + eta,
    D = sum_r d_r, A = sum_r |q'_r| + |residual_in| (the 2^-45 A covers the float64 sum itself).
    tests/test_soak_cpu.py checks that reference() and both ends of its per-element bracket are
    always accepted.
    """
    W, _, H = allreduce_in_by_rank.shape
    T, K = tokens, top_k
    routed = allreduce_in_by_rank.index_select(1, route_rows).float()  # [W, T*K, H]
    if scale is not None:
        routed.mul_(scale.reshape(1, T * K, 1).float())
    routed = routed.view(W, T, K, H)
    partials = routed.sum(2)
    magnitudes = routed.abs_().sum(2)
    rsf32 = f32(rsf)
    if rsf32 != 1.0:
        partials.mul_(rsf32)
        magnitudes.mul_(abs(rsf32))
    if shared is not None:
        shared32 = shared.float()
        partials.add_(shared32)
        magnitudes.add_(shared32.abs())
    rounded = partials.to(dtype).double()  # q'_r
    residual = residual_in.double()
    expected = rounded.sum(0).add_(residual)  # S
    # tol expanded into one coefficient per magnitude (D and A substituted), 1 + 2^-20 of slack on each
    u, eta = UNIT_ROUNDOFF[dtype], SUBNORMAL_SPACING[dtype] / 2
    gamma_k = 2.0 * gamma(K + 4) * (1.0 + 2.0 ** -20)
    gamma_w = gamma(W + 1)
    slack, big = 1.0 + 2.0 ** -20, (1.0 + u) * (1.0 + gamma_w)
    c_q = slack * (big * 2.01 * u + (1.0 + u) * gamma_w + 2.0 ** -45)  # times sum_r |q'_r|
    c_m = slack * big * 1.01 * gamma_k                                 # times sum_r m_r
    c_r = slack * ((1.0 + u) * gamma_w + 2.0 ** -45)                   # times |residual_in|
    c_0 = slack * (big * 3.0 * eta * W + eta)
    tol = rounded.abs_().sum(0).mul_(c_q).add_(magnitudes.sum(0).double(), alpha=c_m).add_(residual.abs(), alpha=c_r)
    tol.add_(expected.abs(), alpha=slack * u).add_(c_0)
    return expected, tol


def norm_expectation(residual_out: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight_bias: int,
                     dtype: torch.dtype):
    """(y, tol), float64: the RMSNorm of this residual_out in float64 and the distance a correct norm_out
    may have from it: |norm_out - y| <= (u + b + u b) |y| + eta, b = norm_rel_bound(H) (float32
    evaluation), u the final rounding to dtype."""
    y = rmsnorm_f64(residual_out, norm_weight, eps, weight_bias)
    u, eta = UNIT_ROUNDOFF[dtype], SUBNORMAL_SPACING[dtype] / 2
    b = norm_rel_bound(residual_out.shape[-1])
    tol = y.abs().mul_((u + b + u * b) * (1.0 + 2.0 ** -20)).add_(eta)
    return y, tol


def count_bad(got: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """Elements outside the tolerance (NaN counts as outside), as a 0-dim int64 tensor."""
    return (~((got.double() - expected).abs() <= tol)).sum()
