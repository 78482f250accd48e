"""The MoE tails of real model families mapped onto the op's arguments (docs/models-and-engines.md).

Each family's MoE block and RMSNorm are Hugging Face transformers' own modules (5.x: a fused
`...Experts` module holding gate_up_proj [E, 2I, H] and down_proj [E, H, I], a router module, and
DeepSeek-V3's shared expert MLP), built from a config made in code at the model's real hidden size
and top_k, with fewer experts and a small intermediate size, random weights, nothing downloaded.

What an engine holds where the tail starts, and what this module takes from the model's own code:

* the router's top-k weights and indices: the router module's forward (so DeepSeek-V3's
  routed_scaling_factor is folded into its weights, Qwen3-MoE renormalizes when norm_topk_prob is
  set, Mixtral always renormalizes);
* each route's expert row, unweighted: the experts module's forward for that one route with weight 1;
* the shared expert's row (DeepSeek-V3): the shared expert module's forward;
* the next norm's weight and eps: the RMSNorm module's (weight_bias 0: these norms scale by gamma).

Tensor parallelism splits the intermediate dimension of every expert and of the shared expert over
the ranks (`split_for_tensor_parallel`): each rank's expert rows and shared row are then partial sums
whose sum over the ranks is the layer's output. `tail_case` lays one call out per rank as the op's
arguments, a `moe_ar_tools.reference.Case` that the float64 reference and the tests' checks read.

transformers is imported only inside the functions that build models: it is a test and example
dependency (the `test` and `examples` extras), never the runtime's.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch

from moe_ar_tools.reference.cases import Case
from moe_ar_tools.reference.contract import finalize_partial, rmsnorm_f64
from moe_ar_tools.reference.rounding import f32

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral")

# The real models' tail dimensions; experts and intermediate sizes are cut down to keep the tests fast.
REAL = {
    "deepseek_v3": dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, n_group=8, topk_group=4, eps=1e-6),
    "qwen3_moe": dict(hidden=2048, top_k=8, eps=1e-6),   # Qwen3-30B-A3B
    "mixtral": dict(hidden=4096, top_k=2, eps=1e-5),     # Mixtral-8x7B
}
SCALINGS = ("router", "op")  # who applies DeepSeek-V3's routed_scaling_factor: its router, or the op


@dataclasses.dataclass
class ModelTail:
    """One MoE block and the RMSNorm that follows it (the next layer's input_layernorm)."""
    family: str
    config: object
    moe: torch.nn.Module
    next_norm: torch.nn.Module

    @property
    def experts(self):
        return self.moe.experts

    @property
    def router(self):
        return self.moe.gate

    @property
    def shared_expert(self):
        return getattr(self.moe, "shared_experts", None)

    @property
    def routed_scaling_factor(self) -> float:
        return float(getattr(self.config, "routed_scaling_factor", 1.0))


def make_config(family: str, *, num_experts: int = 16, intermediate_size: int = 64):
    """The family's config at its real hidden size, top_k, norm eps and routing options."""
    import transformers
    if family not in REAL:
        raise ValueError(f"family: {family!r} is not one of {FAMILIES}")
    real = REAL[family]
    common = dict(hidden_size=real["hidden"], num_experts_per_tok=real["top_k"], rms_norm_eps=real["eps"],
                  experts_implementation="eager", num_hidden_layers=2)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            n_routed_experts=num_experts, moe_intermediate_size=intermediate_size, n_shared_experts=1,
            routed_scaling_factor=real["routed_scaling_factor"], n_group=real["n_group"],
            topk_group=real["topk_group"], norm_topk_prob=True, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_experts=num_experts, moe_intermediate_size=intermediate_size,
                                           norm_topk_prob=True, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=num_experts, intermediate_size=intermediate_size,
                                          **common)
    raise ValueError(f"family: {family!r} is not one of {FAMILIES}")


def _module_classes(family: str):
    """(MoE block class, RMSNorm class) of the family, from transformers."""
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        return m.DeepseekV3MoE, m.DeepseekV3RMSNorm
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m
        return m.Qwen3MoeSparseMoeBlock, m.Qwen3MoeRMSNorm
    if family == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as m
        return m.MixtralSparseMoeBlock, m.MixtralRMSNorm
    raise ValueError(f"family: {family!r} is not one of {FAMILIES}")


def build_tail(family: str, *, seed: int = 0, dtype=torch.float32, device="cpu", num_experts: int = 16,
               intermediate_size: int = 64) -> ModelTail:
    """The family's MoE block and next RMSNorm with random weights (drawn in float32 on the CPU from
    `seed`, then cast), in eval mode. Weights are scaled so that every stage keeps values near 1."""
    config = make_config(family, num_experts=num_experts, intermediate_size=intermediate_size)
    moe_class, norm_class = _module_classes(family)
    moe = moe_class(config)
    norm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(moe.named_parameters()) + list(norm.named_parameters()):
            if p.dim() == 1:  # the norm's gamma
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # projections: unit-variance outputs; fan_in is the last dimension
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        bias = getattr(moe.gate, "e_score_correction_bias", None)
        if bias is not None:  # DeepSeek-V3: a bias that steers the choice of experts, not their weights
            bias.copy_(0.05 * torch.randn(bias.shape, generator=g))
    _check_expressible(family, moe, norm)
    moe = moe.to(device=device, dtype=dtype).eval().requires_grad_(False)
    norm = norm.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if hasattr(moe.gate, "e_score_correction_bias"):  # the model keeps it in float32 (_keep_in_fp32_modules)
        moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
    if family == "deepseek_v3":
        moe.gate.weight.data = moe.gate.weight.data.float()  # kept in float32 by the model too
    return ModelTail(family, config, moe, norm)


def _check_expressible(family, moe, norm):
    """ValueError naming what the op cannot take: a bias on the experts' output (it would be added
    after the routed sum), a norm without weight. None of the three families has either; the check
    keeps a future transformers layout from being mapped onto something else."""
    experts = moe.experts
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
        raise ValueError(f"{family}: experts: expected transformers 5.x fused experts (gate_up_proj, down_proj), "
                         f"got {type(experts).__name__}")
    if getattr(experts, "has_bias", False) or hasattr(experts, "down_proj_bias"):
        raise ValueError(f"{family}: experts: a bias after the expert GEMM is not expressible (the op has no "
                         f"argument for a row added after the routed sum)")
    if getattr(norm, "weight", None) is None:
        raise ValueError(f"{family}: norm_weight: a norm without weight is not expressible")


# ---- what an engine has at the tail's start ---------------------------------------------------------

@contextlib.contextmanager
def _router_without_scaling(tail: ModelTail):
    """DeepSeek-V3's router with its routed_scaling_factor set to 1 for one call (the op applies it)."""
    router = tail.router
    saved = getattr(router, "routed_scaling_factor", None)
    if saved is not None:
        router.routed_scaling_factor = 1.0
    try:
        yield
    finally:
        if saved is not None:
            router.routed_scaling_factor = saved


@torch.no_grad()
def route(tail: ModelTail, x: torch.Tensor, *, scaling: str = "router"):
    """(weights [T, K], indices [T, K], routed_scaling_factor) from the router module's own forward.

    scaling "router": the weights as the model's router returns them (DeepSeek-V3 folds
    routed_scaling_factor in), and 1.0 for the op; "op": DeepSeek-V3's router run with its factor
    set to 1, and the factor returned for the op's routed_scaling_factor. The other families have no
    factor: both give their weights and 1.0."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling: {scaling!r} is not one of {SCALINGS}")
    x2 = x.reshape(-1, x.shape[-1])
    with _router_without_scaling(tail) if scaling == "op" else contextlib.nullcontext():
        out = tail.router(x2)
    if not (isinstance(out, tuple) and len(out) == 3):  # transformers before 5.17 routed in the MoE block
        raise RuntimeError(f"{tail.family}: the router returned {type(out).__name__}, not (logits, weights, "
                           f"indices): needs transformers >= 5.17")
    _, weights, indices = out
    return weights, indices, tail.routed_scaling_factor if scaling == "op" else 1.0


@torch.no_grad()
def expert_rows(experts: torch.nn.Module, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[T, K, H]: route k of token t through expert indices[t, k], unweighted, by the experts module's
    own forward (one route at a time, weight 1: the module's sum of one term, exact)."""
    x2 = x.reshape(-1, x.shape[-1])
    ones = torch.ones(x2.shape[0], 1, dtype=x2.dtype, device=x2.device)
    return torch.stack([experts(x2, indices[:, k:k + 1], ones) for k in range(indices.shape[1])], dim=1)


def permute_by_expert(rows: torch.Tensor, indices: torch.Tensor):
    """(allreduce_in [T*K, H], expanded_idx_to_permuted_idx [T, K] int32): the rows sorted by expert
    (stable, as a grouped GEMM writes them), and where route (t, k) landed."""
    T, K, H = rows.shape
    order = torch.argsort(indices.reshape(-1), stable=True)
    idx = torch.empty(T * K, dtype=torch.int32, device=rows.device)
    idx[order] = torch.arange(T * K, dtype=torch.int32, device=rows.device)
    return rows.reshape(T * K, H)[order].contiguous(), idx.view(T, K)


@torch.no_grad()
def model_output(tail: ModelTail, x: torch.Tensor, residual: torch.Tensor):
    """(residual_out, norm_out) as the model computes them: r = residual + moe(x); next_norm(r)."""
    r = residual + tail.moe(x.unsqueeze(0)).squeeze(0)
    return r, tail.next_norm(r)


# ---- tensor parallelism -----------------------------------------------------------------------------

def _slice_experts(experts, rank, world_size):
    """A copy of the fused experts module holding rank's 1/W of every expert's intermediate dimension:
    the gate and up rows of gate_up_proj (stored [gate; up]) and the matching columns of down_proj."""
    inter = experts.down_proj.shape[-1]
    part = inter // world_size
    lo, hi = rank * part, (rank + 1) * part
    out = copy.copy(experts)
    out._parameters = dict(experts._parameters)
    gate_up = experts.gate_up_proj.data
    out.gate_up_proj = torch.nn.Parameter(torch.cat([gate_up[:, lo:hi], gate_up[:, inter + lo:inter + hi]], 1),
                                          requires_grad=False)
    out.down_proj = torch.nn.Parameter(experts.down_proj.data[:, :, lo:hi].contiguous(), requires_grad=False)
    out.intermediate_dim = part
    return out


def _slice_mlp(mlp, rank, world_size):
    """A copy of a gated MLP (gate_proj, up_proj, down_proj linears) with rank's 1/W of its
    intermediate dimension (column-parallel gate and up, row-parallel down, as tensor parallelism)."""
    out = copy.deepcopy(mlp)
    part = mlp.down_proj.weight.shape[1] // world_size
    lo, hi = rank * part, (rank + 1) * part
    out.gate_proj.weight.data = mlp.gate_proj.weight.data[lo:hi].contiguous()
    out.up_proj.weight.data = mlp.up_proj.weight.data[lo:hi].contiguous()
    out.down_proj.weight.data = mlp.down_proj.weight.data[:, lo:hi].contiguous()
    out.intermediate_size = part
    return out


@dataclasses.dataclass
class RankSlice:
    """One tensor-parallel rank's experts and shared expert (the router is replicated)."""
    experts: torch.nn.Module
    shared_expert: torch.nn.Module | None


def split_for_tensor_parallel(tail: ModelTail, world_size: int) -> list:
    """W RankSlices; the intermediate sizes must divide by W (ValueError naming world_size)."""
    inter = tail.experts.down_proj.shape[-1]
    shared = tail.shared_expert
    sizes = [inter] + ([shared.down_proj.weight.shape[1]] if shared is not None else [])
    if world_size < 1 or any(s % world_size for s in sizes):
        raise ValueError(f"world_size: {world_size} does not divide the intermediate sizes {sizes}")
    if world_size == 1:
        return [RankSlice(tail.experts, shared)]
    return [RankSlice(_slice_experts(tail.experts, r, world_size),
                      _slice_mlp(shared, r, world_size) if shared is not None else None)
            for r in range(world_size)]


# ---- the op's arguments -----------------------------------------------------------------------------

def _weights_for(weights: torch.Tensor, dtype) -> torch.Tensor:
    """Router weights as the op reads them: float32 or the activation dtype as they are, else float32
    (a float64 model's weights stay float64 for the float64 reference)."""
    if weights.dtype in (torch.float32, dtype) or dtype == torch.float64:
        return weights.contiguous()
    return weights.float().contiguous()


@torch.no_grad()
def tail_case(tail: ModelTail, x: torch.Tensor, residual: torch.Tensor, *, world_size: int = 1,
              scaling: str = "router", dtype=None, device=None, seed: int = 0) -> Case:
    """Every rank's op arguments for the tail of `tail` on tokens x [T, H] with residual [T, H].

    Routing from the router's own forward (`route`); each rank's expert rows and shared row from its
    slice of the modules (`split_for_tensor_parallel`), permuted by expert; residual_in, norm_weight
    and eps from the inputs and the next norm. Tensors are cast to dtype (default: the model's) and
    moved to device (default: x's). The Case's meta carries what the reference needs."""
    dtype = dtype or x.dtype
    device = torch.device(device) if device is not None else x.device
    weights, indices, rsf = route(tail, x, scaling=scaling)
    ranks = []
    for part in split_for_tensor_parallel(tail, world_size):
        rows, idx = permute_by_expert(expert_rows(part.experts, x, indices), indices)
        shared = part.shared_expert(x) if part.shared_expert is not None else None
        ranks.append(dict(
            allreduce_in=rows.to(device=device, dtype=dtype),
            expanded_idx_to_permuted_idx=idx.to(device),
            expert_scale_factor=_weights_for(weights, dtype).to(device),
            routed_scaling_factor=f32(rsf),
            shared_expert_output=None if shared is None else shared.to(device=device, dtype=dtype).contiguous(),
            residual_in=residual.to(device=device, dtype=dtype).contiguous(),
            norm_weight=tail.next_norm.weight.detach().to(device=device, dtype=dtype).contiguous(),
            eps=float(tail.next_norm.variance_epsilon),
            weight_bias=0,
        ))
    T, K = indices.shape
    meta = dict(seed=seed, world_size=world_size, tokens=T, hidden=x.shape[-1], top_k=K, dtype=dtype,
                padded_rows=0, drop_frac=0.0, scale_kind=str(ranks[0]["expert_scale_factor"].dtype),
                shared=ranks[0]["shared_expert_output"] is not None, rsf=f32(rsf), weight_bias=0,
                eps=ranks[0]["eps"], family=tail.family, scaling=scaling)
    return Case(ranks, meta)


@torch.no_grad()
def combined_case(tail: ModelTail, x: torch.Tensor, residual: torch.Tensor, *, dtype=None, device=None,
                  seed: int = 0) -> Case:
    """World size 1 after an all-to-all combine (attention data parallelism with expert parallelism):
    the combine hands over each token's routed rows already weighted and summed, one row per token,
    so the op takes them as top_k 1 with no router weights (weight 1) and routed_scaling_factor 1;
    the shared expert, not part of the combine, stays its own argument. The combined row here is the
    experts module's own forward with the router's weights (DeepSeek-V3's factor folded in)."""
    dtype = dtype or x.dtype
    device = torch.device(device) if device is not None else x.device
    weights, indices, _ = route(tail, x, scaling="router")
    x2 = x.reshape(-1, x.shape[-1])
    combined = tail.experts(x2, indices, weights)  # as the MoE block's forward calls it
    shared = tail.shared_expert(x2) if tail.shared_expert is not None else None
    T = x2.shape[0]
    kw = dict(allreduce_in=combined.to(device=device, dtype=dtype).contiguous(),
              expanded_idx_to_permuted_idx=torch.arange(T, dtype=torch.int32, device=device).view(T, 1),
              expert_scale_factor=None, routed_scaling_factor=1.0,
              shared_expert_output=None if shared is None else shared.to(device=device, dtype=dtype).contiguous(),
              residual_in=residual.to(device=device, dtype=dtype).contiguous(),
              norm_weight=tail.next_norm.weight.detach().to(device=device, dtype=dtype).contiguous(),
              eps=float(tail.next_norm.variance_epsilon), weight_bias=0)
    meta = dict(seed=seed, world_size=1, tokens=T, hidden=x.shape[-1], top_k=1, dtype=dtype, padded_rows=0,
                drop_frac=0.0, scale_kind=None, shared=shared is not None, rsf=1.0, weight_bias=0, eps=kw["eps"],
                family=tail.family, scaling="combined")
    return Case([kw], meta)


def exact_output(case: Case):
    """(residual_out, norm_out) in float64 from a Case's own inputs, nothing rounded: residual_in plus
    every rank's partial (docs/operation.md, "The math"), then RMSNorm. The model's value of the same
    rows, where the reference (moe_ar_tools/reference/) gives the contract's rounded one."""
    first = case[0]
    total = first["residual_in"].to(torch.float64).clone()
    for kw in case:
        total += finalize_partial(kw["allreduce_in"], kw["expanded_idx_to_permuted_idx"], kw["expert_scale_factor"],
                                  kw["routed_scaling_factor"], kw["shared_expert_output"])
    return total, rmsnorm_f64(total, first["norm_weight"], first["eps"], first["weight_bias"])


def tokens(tail: ModelTail, T: int, *, seed: int = 0, dtype=None, device=None):
    """(x, residual): x as a post-attention RMSNorm would hand it over (rows of RMS about 1), residual
    with a larger spread, drawn in float32 on the CPU from seed and cast."""
    H = tail.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    residual = 2.0 * torch.randn(T, H, generator=g)
    dtype = dtype or tail.next_norm.weight.dtype
    device = device or tail.next_norm.weight.device
    return x.to(device=device, dtype=dtype), residual.to(device=device, dtype=dtype)
