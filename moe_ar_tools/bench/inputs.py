"""Each point's random inputs (the same routing on every rank, each rank's own partials), the
float64 values the outputs are checked against (moe_ar_tools.reference's functions), and the error
measure of the checks (rel_err, worst)."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from moe_ar_tools.bench.config import EPS, ROUTED_SCALING_FACTOR, Shape


@dataclass
class InputSet:
    """One call's inputs on this rank (routing, scales, residual and gamma equal on every rank)."""
    allreduce_in: object
    idx: object
    scale: object
    shared: object
    residual: object
    norm_weight: object


def _generator(device, seed: int, *key) -> object:
    """A torch generator seeded from (seed, key): the same on every rank for the same key."""
    import torch
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(repr(key).encode())) % (2 ** 63))
    return generator


def make_input_sets(shape: Shape, tokens: int, count: int, dtype, rank: int, seed: int, device) -> list[InputSet]:
    """`count` random input sets. No route is dropped (every route reads its row)."""
    import torch
    T, H, K = tokens, shape.hidden, shape.top_k
    sets = []
    for set_index in range(count):
        common = _generator(device, seed, "common", H, K, T, set_index)  # the same on every rank
        own = _generator(device, seed, "rank", rank, H, K, T, set_index)  # this rank's
        idx = torch.randperm(T * K, generator=common, device=device).view(T, K).to(torch.int32)
        scale = torch.rand(T, K, generator=common, device=device) + 0.05
        scale /= scale.sum(-1, keepdim=True)  # top-k renormalized router weights, fp32
        residual = torch.randn(T, H, generator=common, device=device, dtype=dtype)
        norm_weight = (1 + 0.1 * torch.randn(H, generator=common, device=device)).to(dtype)
        allreduce_in = (0.5 * torch.randn(T * K, H, generator=own, device=device, dtype=dtype))
        shared = (0.5 * torch.randn(T, H, generator=own, device=device, dtype=dtype)) if shape.shared else None
        sets.append(InputSet(allreduce_in, idx, scale, shared, residual, norm_weight))
    return sets


def contract_outputs(inputs: InputSet, dtype, group=None) -> tuple:
    """(residual_out, norm_out) of the precision contract as float32 tensors: this rank's partial in
    float64 rounded to dtype once (not at world size 1, where nothing travels), the cross-rank sum in
    float64 (an NCCL float64 all_reduce over `group`; None: world size 1, no process group),
    residual_out rounded to dtype once, RMSNorm of it in float64 (moe_ar_tools.reference's functions)."""
    from moe_ar_tools import reference as ref
    partial = ref.finalize_partial(inputs.allreduce_in, inputs.idx, inputs.scale, ROUTED_SCALING_FACTOR,
                                   inputs.shared)
    import torch.distributed as dist
    alone = group is None or dist.get_world_size(group) == 1
    total = partial if alone else ref.round_to_dtype(partial, dtype).double()
    del partial
    if group is not None:
        dist.all_reduce(total, group=group)
    residual = ref.round_to_dtype(total + inputs.residual.double(), dtype)
    del total
    norm = ref.rmsnorm_f64(residual, inputs.norm_weight, EPS, 0)
    return residual.float(), norm.float()


def rel_err(x, want) -> float:
    """||x - want|| / ||want|| (NaN when x holds NaN)."""
    import torch
    diff = torch.linalg.vector_norm(x.float() - want)
    norm = torch.linalg.vector_norm(want)
    return float(diff / norm) if float(norm) > 0 else float(diff)


def worst(a: float, b: float) -> float:
    """The larger error, NaN (an output left unwritten, still poisoned) above any number: Python's
    max(0.0, nan) is 0.0."""
    return b if math.isnan(b) or b > a else a
