"""The op's finalize and its residual + RMSNorm epilogue written with torch ops, as an engine without
fusion runs them: the unfused baselines of every world size (multi_gpu/systems.py around an
all-reduce, moe_ar_tools/baselines/torch_chain.py at world size 1), eager or under torch.compile."""
from __future__ import annotations

from moe_ar_tools.bench.config import EPS, ROUTED_SCALING_FACTOR


def finalize_into(partial, allreduce_in, idx, scale, shared) -> None:
    """partial[T, H] = rsf * sum_k scale[t, k] * allreduce_in[idx[t, k]] + shared, with torch ops as
    an engine without fusion runs them: gather the rows, one batched matmul [1, K] x [K, H] per
    token (fp32 accumulation, dtype output), add the shared expert. Tensors only, so that
    torch.compile traces it as is (multi_gpu/systems.py compiled_fns)."""
    import torch
    T, K = idx.shape
    H = allreduce_in.shape[1]
    rows = allreduce_in.index_select(0, idx.view(-1)).view(T, K, H)
    weights = (scale * ROUTED_SCALING_FACTOR).to(rows.dtype).unsqueeze(1)
    torch.bmm(weights, rows, out=partial.view(T, 1, H))
    if shared is not None:
        partial.add_(shared)


def epilogue_into(residual_out, norm_out, reduced, residual, norm_weight) -> None:
    """residual_out = reduced + residual_in; norm_out = RMSNorm (fp32 statistics, as in vLLM's
    native RMSNorm: normalize in fp32, round, multiply by gamma)."""
    import torch
    torch.add(reduced, residual, out=residual_out)
    hidden = residual_out.float()
    hidden = hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + EPS)
    torch.mul(hidden.to(reduced.dtype), norm_weight, out=norm_out)
