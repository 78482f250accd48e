"""Random cases: every rank's inputs of one call, reproducible from a seed, with the float64
reference of a case and the usual NVFP4 global scale."""
from __future__ import annotations

import math
import secrets

import torch

from moe_ar_tools.reference.contract import reference
from moe_ar_tools.reference.quant import E4M3_MAX
from moe_ar_tools.reference.rounding import as_torch_dtype, dtype_name, f32


class Case(list):
    """A list of per-rank kwargs dicts (runtime parameter names), plus .meta."""

    def __init__(self, ranks, meta):
        super().__init__(ranks)
        self.meta = meta

    @property
    def seed(self):
        return self.meta["seed"]

    def describe(self) -> str:
        m = self.meta
        return (f"seed={m['seed']} W={m['world_size']} T={m['tokens']} H={m['hidden']} K={m['top_k']} "
                f"dtype={dtype_name(m['dtype'])} padded_rows={m['padded_rows']} drop_frac={m['drop_frac']} "
                f"scale={m['scale_kind']} shared={m['shared']} rsf={m['rsf']} wb={m['weight_bias']} eps={m['eps']}")


def make_case(world_size, tokens, hidden, top_k, dtype, *, padded_rows=0, drop_frac=0.15,
              scale_kind="fp32", shared=True, rsf=1.0, weight_bias=0, eps=1e-6, seed=None,
              device="cpu", gen_device=None, poison_unused_rows=True) -> Case:
    """Random inputs for every rank (reproducible from seed).

    device: one device for all ranks, or a list with one device per rank.
    gen_device: where the random numbers are drawn (default: rank 0's device).
    Each rank gets its own allreduce_in and shared_expert_output; routing,
    expert scales, residual_in and norm_weight have the same values on every rank
    (cloned per rank). Rows of allreduce_in that no valid route references are
    NaN when poison_unused_rows (a kernel must never read them into a result).
    """
    assert scale_kind in (None, "fp32", "dtype"), scale_kind
    dtype = as_torch_dtype(dtype)
    if seed is None:
        seed = secrets.randbits(62)
    devices = list(device) if isinstance(device, (list, tuple)) else [device] * world_size
    devices = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in devices]
    assert len(devices) == world_size
    gdev = torch.device(gen_device) if gen_device is not None else devices[0]
    g = torch.Generator(device=gdev)
    g.manual_seed(seed)
    T, H, K, R = tokens, hidden, top_k, tokens * top_k + padded_rows

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=gdev, dtype=torch.float32)

    def rand(*shape):
        return torch.rand(*shape, generator=g, device=gdev, dtype=torch.float32)

    perm = torch.randperm(R, generator=g, device=gdev)[: T * K].reshape(T, K).to(torch.int32)
    dropped = rand(T, K) < drop_frac
    idx = torch.where(dropped, torch.full_like(perm, -1), perm)
    referenced = torch.zeros(R, dtype=torch.bool, device=gdev)
    referenced[idx[idx >= 0].long()] = True
    if scale_kind is None:
        scale = None
    else:
        scale = rand(T, K) * 0.95 + 0.05
        if scale_kind == "dtype":
            scale = scale.to(dtype)
    residual = (randn(T, H) * 1.5).to(dtype)
    gamma_w = (randn(H) * 0.1 + (1.0 if weight_bias == 0 else 0.0)).to(dtype)
    ranks = []
    for r in range(world_size):
        mag = 0.5 + 1.5 * float(rand(1))
        x = randn(R, H) * mag
        if poison_unused_rows:
            x[~referenced] = math.nan
        x = x.to(dtype)
        sh = (randn(T, H) * mag * 0.5).to(dtype) if shared else None
        dev = devices[r]
        ranks.append(dict(
            allreduce_in=x.to(dev),
            expanded_idx_to_permuted_idx=idx.clone().to(dev),
            expert_scale_factor=None if scale is None else scale.clone().to(dev),
            routed_scaling_factor=f32(rsf),
            shared_expert_output=None if sh is None else sh.to(dev),
            residual_in=residual.clone().to(dev),
            norm_weight=gamma_w.clone().to(dev),
            eps=eps,
            weight_bias=weight_bias,
        ))
    meta = dict(seed=seed, world_size=world_size, tokens=T, hidden=H, top_k=K, dtype=dtype,
                padded_rows=padded_rows, drop_frac=drop_frac, scale_kind=scale_kind, shared=shared,
                rsf=f32(rsf), weight_bias=weight_bias, eps=eps)
    return Case(ranks, meta)


def reference_for(case: Case) -> dict:
    m = case.meta
    return reference(list(case), m["eps"], m["weight_bias"], m["rsf"], m["dtype"])


def typical_global_scale(norm_out: torch.Tensor) -> float:
    """The usual NVFP4 global scale: 448 * 6 / amax (as fp32)."""
    return f32(E4M3_MAX * 6.0 / float(norm_out.abs().max().float()))
