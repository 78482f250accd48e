"""Reference for MoE finalize + all-reduce + residual add + RMSNorm (+ NVFP4).

Pure torch; every function works on CPU tensors (and on CUDA tensors, for cheap
checks inside GPU tests). Follows docs/operation.md:

* Precision contract: each rank's partial is computed in float64 and rounded
  ONCE to the dtype D (it travels as D); the cross-rank sum plus residual_in is
  float64, rounded once to D -> residual_out; norm_out is D of the float64
  RMSNorm of residual_out (as float64). At world size 1 nothing travels: the
  partial is not rounded, residual_out = D(partial + residual_in).
* Rounding float64 -> D is done correctly (single rounding). torch converts
  float64 -> bf16/fp16 through float32, which is a double rounding; we round to
  odd at float32 first (24 >= p + 2 bits), which makes the second rounding exact.
* NVFP4 follows docs/operation.md step by step in float32 arithmetic: every multiply and
  division is a float32 tensor op (tensor / tensor, never tensor / python scalar,
  which CUDA torch turns into a multiply by a rounded reciprocal).

Besides the reference values, this module derives the set of results a correct
kernel may legally produce (the kernel accumulates in float32, not float64):
`reference()` returns per-element bounds [residual_lo, residual_hi] and
`norm_bracket()` gives the same for norm_out given the kernel's own residual_out.
The derivation is in the docstrings; `check_outputs()` applies them.
"""
from __future__ import annotations

import math
import secrets

import torch

# The runtime's own output sizes: a reference or test imports them, never restates them.
from dispatch.op import FP8_GROUP, fp8_scale_shape, scale_out_bytes

# ---- dtypes and rounding -----------------------------------------------------------

NAME_TO_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_TO_NAME = {v: k for k, v in NAME_TO_DTYPE.items()}
_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16"}

U32 = 2.0 ** -24  # unit roundoff of float32
# Unit roundoff u (half the spacing at 1.0) of each format: RN error <= u * |x|.
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: U32}
# Smallest subnormal spacing: absolute RN error <= half of it near zero.
SUBNORMAL_SPACING = {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133, torch.float32: 2.0 ** -149}

POISON_BYTE = 0xAB


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


# ---- the op in float64 --------------------------------------------------------------

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


# ---- NVFP4 --------------------------------------------------------------------------

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7
# Boundary between code c and c+1: (midpoint, does an exact tie go up?).
# Ties go to the even code: up exactly when c + 1 is even (c odd).
E2M1_BOUNDARIES = (
    (0.25, False),  # 0 | 0.5   -> tie to 0   (code 0)
    (0.75, True),   # 0.5 | 1   -> tie to 1   (code 2)
    (1.25, False),  # 1 | 1.5   -> tie to 1   (code 2)
    (1.75, True),   # 1.5 | 2   -> tie to 2   (code 4)
    (2.5, False),   # 2 | 3     -> tie to 2   (code 4)
    (3.5, True),    # 3 | 4     -> tie to 4   (code 6)
    (5.0, False),   # 4 | 6     -> tie to 4   (code 6); above 6 saturates at code 7
)
E4M3_MAX = 448.0
E4M3_NAN_BYTE = 0x7F  # the NaN the saturating convert writes, whatever the NaN's sign


def e2m1_nibbles(v: torch.Tensor) -> torch.Tensor:
    """float32 values -> E2M1 nibbles (uint8 0..15): RNE, saturating to 6, sign kept.

    The sign bit comes from v's sign bit: -0.0 and negatives that round to 0 give 0x8.
    """
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, tie_up in E2M1_BOUNDARIES:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    n = nibbles.to(torch.int64)
    mag = table[n & 7]
    return torch.where((n & 8) != 0, -mag, mag)


def e4m3_satfinite_bytes(sf: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3 bytes as the GPU's saturating convert: RNE, saturating to +-448 (infinities
    too), every NaN to 0x7F (clamp, then torch's RNE convert; torch alone would keep a NaN's sign)."""
    b = sf.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(sf), torch.full_like(b, E4M3_NAN_BYTE), b)


def _canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """Every NaN as the positive one: a GPU's float32 arithmetic returns that NaN whatever NaN or
    invalid operation (0 * inf, 0 / 0) made it, where a CPU's may return a negative one."""
    return torch.where(torch.isnan(x), torch.full_like(x, math.nan), x)


def _roundup(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def swizzle_offsets(tokens: int, hidden: int, device="cpu") -> torch.Tensor:
    """int64 [tokens, hidden/16]: byte offset of scale (m, k) in the 128x4 layout."""
    num_k_tiles = (hidden + 63) // 64
    m = torch.arange(tokens, dtype=torch.int64, device=device)[:, None]
    k = torch.arange(hidden // 16, dtype=torch.int64, device=device)[None, :]
    return ((m // 128) * (num_k_tiles * 512) + (k // 4) * 512
            + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4))


def unswizzle(scale_bytes: torch.Tensor, tokens: int, hidden: int) -> torch.Tensor:
    """Decoder rule: reshape (rows/128, cols/4, 32, 4, 4), permute (0, 3, 2, 1, 4)."""
    rows, cols = _roundup(tokens, 128), _roundup(hidden // 16, 4)
    b = scale_bytes.reshape(-1)[: rows * cols]
    return (b.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
            .reshape(rows, cols)[:tokens, : hidden // 16])


def _gs_float(global_scale) -> float:
    return float(torch.as_tensor(global_scale).detach().to("cpu", torch.float32).reshape(-1)[0])


def _gs_like(amax: torch.Tensor, global_scale) -> torch.Tensor:
    """The global scale as a float32 tensor to combine with amax: a tensor on amax's device stays
    there (no read back to the host, so the soak's check never waits for the GPU); anything else
    becomes a full tensor of its float32 value. Either way every operation with it is tensor by
    tensor, so it rounds the same."""
    if isinstance(global_scale, torch.Tensor) and global_scale.device == amax.device:
        return global_scale.detach().reshape(-1)[:1].to(torch.float32).reshape((1,) * amax.dim())
    return torch.full_like(amax, _gs_float(global_scale))


def nvfp4_block_scales(x: torch.Tensor, global_scale):
    """Blocked float32 x [T, H/16, 16] -> (amax, sf, sf8 bytes, scale), each [T, H/16].

    docs/operation.md step by step, every operation a float32 tensor op (correctly rounded). For any global
    scale (0, negative, NaN, infinite: dispatch/API.md's table) the same arithmetic as written:
    the convert saturates both ways and writes NaN as 0x7F, and "sf8 != 0" compares the stored byte
    (0x80, -0, is not 0: its scale is 1 / (-0 / gs)); with gs >= +0 no byte 0x80 arises.
    """
    amax = x.abs().amax(-1)
    gs = _gs_like(amax, global_scale)
    sf = (gs * amax) / torch.full_like(amax, 6.0)
    sf8 = e4m3_satfinite_bytes(sf)
    sf8f = sf8.view(torch.float8_e4m3fn).to(torch.float32)
    t = sf8f / gs
    scale = torch.where(sf8 != 0, torch.ones_like(t) / t, torch.zeros_like(t))
    return amax, sf, sf8, scale


def nvfp4_blocks(norm_out: torch.Tensor, global_scale):
    """(quant [T, H/2] uint8, sf8 [T, H/16] uint8): the NVFP4 of norm_out (docs/operation.md) with the E4M3 block
    scale of each (token, 16-element block) before swizzling. global_scale: a float, or a [1]
    float32 tensor (on norm_out's device it is never read back to the host).
    Element 2i goes to the low nibble, 2i+1 to the high one.
    """
    T, H = norm_out.shape
    assert H % 16 == 0, H
    x = norm_out.to(torch.float32).reshape(T, H // 16, 16)
    _, _, sf8, scale = nvfp4_block_scales(x, global_scale)
    nibbles = e2m1_nibbles(_canonical_nan(x * scale[..., None])).reshape(T, H)  # a NaN product: nibble 0
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), sf8


def nvfp4_ref(norm_out: torch.Tensor, global_scale):
    """(quant [T, H/2] uint8, scale_bytes 1-D uint8 of scale_out_bytes(T, H)): nvfp4_blocks with
    the block scales in the 128x4 swizzled layout; padding bytes are 0.

    norm_out is the D-rounded norm output; global_scale a float or [1] tensor (fp32).
    """
    T, H = norm_out.shape
    quant, sf8 = nvfp4_blocks(norm_out, global_scale)
    scale_bytes = torch.zeros(scale_out_bytes(T, H), dtype=torch.uint8, device=norm_out.device)
    scale_bytes[swizzle_offsets(T, H, device=norm_out.device).reshape(-1)] = sf8.reshape(-1)
    return quant, scale_bytes


def nvfp4_dequant(quant: torch.Tensor, scale_bytes: torch.Tensor, global_scale, tokens: int, hidden: int):
    """float32 [T, H]: e2m1 value * float(sf8) / gs."""
    q = quant.reshape(tokens, hidden // 2)
    nib = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(tokens, hidden)
    vals = e2m1_decode(nib).reshape(tokens, hidden // 16, 16)
    sf = unswizzle(scale_bytes, tokens, hidden).contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    gs = torch.full_like(sf, _gs_float(global_scale))
    return (vals * (sf / gs)[..., None]).reshape(tokens, hidden)


# ---- random cases -------------------------------------------------------------------

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


# ---- outputs and checks -------------------------------------------------------------

FP8_POISON_BYTE = 0x7F  # an E4M3 NaN: the kernel clamps before converting, so it never writes one


def alloc_outputs(case: Case, quant=None, *, extra_scale_bytes=0, poison_byte=POISON_BYTE, fp8_scale_layout="row"):
    """Per-rank dicts of preallocated, poisoned outputs (NaN floats and FP8, poison_byte uint8)."""
    m = case.meta
    T, H, dtype = m["tokens"], m["hidden"], m["dtype"]
    outs = []
    for kw in case:
        dev = kw["residual_in"].device
        d = dict(norm_out=torch.full((T, H), math.nan, dtype=dtype, device=dev),
                 residual_out=torch.full((T, H), math.nan, dtype=dtype, device=dev))
        if quant == "nvfp4":
            d["quant_out"] = torch.full((T, H // 2), poison_byte, dtype=torch.uint8, device=dev)
            d["scale_out"] = torch.full((scale_out_bytes(T, H) + extra_scale_bytes,), poison_byte,
                                        dtype=torch.uint8, device=dev)
        if quant in ("fp8_group128", "fp8_tensor"):
            d["quant_out"] = torch.full((T, H), FP8_POISON_BYTE, dtype=torch.uint8, device=dev).view(
                torch.float8_e4m3fn)
        if quant == "fp8_group128":
            d["scale_out"] = torch.full(fp8_scale_shape(T, H, fp8_scale_layout), math.nan, dtype=torch.float32,
                                        device=dev)
        outs.append(d)
    return outs


def repoison(outputs: dict, poison_byte=POISON_BYTE):
    for k, t in outputs.items():
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(FP8_POISON_BYTE)
        else:
            t.fill_(poison_byte if t.dtype == torch.uint8 else math.nan)


_PRECISION = {torch.float16: (11, -14), torch.bfloat16: (8, -126), torch.float32: (24, -126)}


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """float64 spacing of dtype at |x| (the gap above |x|'s binade floor)."""
    p, emin = _PRECISION[as_torch_dtype(dtype)]
    x = x.to(torch.float64).abs()
    _, e = torch.frexp(x)  # |x| in [2^(e-1), 2^e)
    e = torch.where(x == 0, emin, torch.clamp(e.to(torch.int64) - 1, min=emin))
    return torch.pow(2.0, (e - p + 1).to(torch.float64))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def _first_bad(mask, *tensors, limit=5):
    idx = mask.nonzero()[:limit].tolist()
    rows = []
    for i in idx:
        rows.append(f"{tuple(i)}: " + ", ".join(f"{float(t[tuple(i)]):.9g}" for t in tensors))
    return "; ".join(rows)


def check_outputs(case: Case, outs, provided=None, *, quant=None, global_scale=None,
                  ref=None, poison_byte=POISON_BYTE, nvfp4_device="cpu", label="", fp8_scale_layout="row",
                  fp8_pow2_scales=False) -> dict:
    """Check every rank's outputs against the contract; raise AssertionError listing all failures.

    outs: list (index = rank) or dict rank -> MoeFinalizeOutputs-like (norm_out,
      residual_out, quant_out, scale_out).
    provided: same indexing, the preallocated poisoned output dicts (from
      alloc_outputs) that were passed to the kernel; checked instead of the
      returned tensors where given (and identity of the returned tensors checked).
    global_scale: float or [1] tensor, or a list of them by rank: the NVFP4 global scale, or
      for quant="fp8_tensor" the FP8 per-tensor scale.
    fp8_scale_layout, fp8_pow2_scales: the options the fp8_group128 call was made with.
    Checks: every element written (no poison left), residual_out in the derived
    bracket, norm_out in the derived bracket of its own residual_out, norm-relative
    error bounds, bit-identical outputs across the ranks given, NVFP4 and FP8 bytes
    (and FP8 float32 scales, bit for bit) exactly equal to the reference rule applied to
    the rank's own norm_out, scale padding zero, bytes past the NVFP4 scale buffer's
    required length untouched.

    The full check runs on the first rank given; a rank whose outputs are bit-identical
    to it passes the same checks, so the full check is repeated only for ranks that differ.
    """
    m = case.meta
    T, H = m["tokens"], m["hidden"]
    if ref is None:
        ref = reference_for(case)
    dev = ref["residual_out"].device
    items = list(outs.items()) if isinstance(outs, dict) else list(enumerate(outs))
    provided_by_rank = {} if not provided else \
        dict(provided.items()) if isinstance(provided, dict) else dict(enumerate(provided))
    n_scale = scale_out_bytes(T, H) if quant == "nvfp4" else None
    fp8 = dict(layout=fp8_scale_layout, pow2=fp8_pow2_scales)
    fails = []
    stats = {"max_res_ulp_from_ref": 0.0, "fully_checked_ranks": []}
    gs_vals = {}
    first = None  # (rank, outputs) of the first fully checked rank
    for r, returned in items:
        given = provided_by_rank.get(r, {})
        tag = f"rank {r}"
        got = {}
        for name in ("residual_out", "norm_out", "quant_out", "scale_out"):
            ret = getattr(returned, name)
            if name in given and ret is not None and ret.data_ptr() != given[name].data_ptr():
                fails.append(f"{tag}: returned {name} is not the preallocated tensor")
            got[name] = given.get(name, ret)
        if quant is None:
            if returned.quant_out is not None or returned.scale_out is not None:
                fails.append(f"{tag}: quant=None but quant_out/scale_out returned")
        else:
            if isinstance(global_scale, (list, tuple)):
                gs_vals[r] = _gs_float(global_scale[r])
            elif global_scale is not None:
                gs_vals[r] = _gs_float(global_scale)
            scale_t = got["scale_out"]
            if quant == "nvfp4" and scale_t is not None and scale_t.dim() == 1 and scale_t.numel() > n_scale \
                    and "scale_out" in given:
                tail = scale_t[n_scale:]
                if (tail != poison_byte).any():
                    fails.append(f"{tag}: wrote {int((tail != poison_byte).sum())} bytes past the "
                                 f"{n_scale} scale bytes it owns")
        names = ("residual_out", "norm_out") + {None: (), "fp8_tensor": ("quant_out",)}.get(
            quant, ("quant_out", "scale_out"))
        if first is not None:
            same = True
            for name in names:
                theirs, mine = first[1][name], got[name]
                if mine is None or theirs.shape[0] != mine.shape[0] or theirs.dtype != mine.dtype:
                    same = False
                    continue
                theirs, mine = _bits(theirs.reshape(-1)[: theirs.numel() if name != "scale_out" else n_scale]), \
                    _bits(mine.to(theirs.device).reshape(-1)[: mine.numel() if name != "scale_out" else n_scale])
                if theirs.shape != mine.shape or not torch.equal(theirs, mine):
                    same = False
                    n_diff = int((theirs != mine).sum()) if theirs.shape == mine.shape else "all"
                    fails.append(f"{tag}: {name} not bit-identical to rank {first[0]} ({n_diff} elements differ)")
            if same and gs_vals.get(r) == gs_vals.get(first[0]):
                continue  # identical to a fully checked rank
        stats["fully_checked_ranks"].append(r)
        fails += _check_rank_fully(case, ref, got, tag, quant, gs_vals.get(r), nvfp4_device, stats, fp8)
        if first is None:
            first = (r, {k: (v.to(dev) if v is not None else None) for k, v in got.items()})
    if fails:
        gs_txt = f" gs={sorted(set(gs_vals.values()))}" if gs_vals else ""
        raise AssertionError(f"{label} [{case.describe()}{gs_txt}]\n  " + "\n  ".join(fails))
    return stats


def _check_rank_fully(case, ref, got, tag, quant, gs_val, nvfp4_device, stats, fp8):
    m = case.meta
    dtype, T, H = m["dtype"], m["tokens"], m["hidden"]
    u = UNIT_ROUNDOFF[dtype]
    dev = ref["residual_out"].device
    fails = []
    res_t, nrm_t = got["residual_out"], got["norm_out"]
    for name, t in (("residual_out", res_t), ("norm_out", nrm_t)):
        if t is None or tuple(t.shape) != (T, H) or t.dtype != dtype:
            return [f"{tag}: {name} shape/dtype {None if t is None else (tuple(t.shape), t.dtype)}"]
    ref_res = ref["residual_out"].to(torch.float64)
    lo = ref["residual_lo"].to(torch.float64)
    hi = ref["residual_hi"].to(torch.float64)
    s64 = ref["residual_out_f64"]
    res = res_t.to(dev).to(torch.float64)
    nrm = nrm_t.to(dev).to(torch.float64)
    for name, t in (("residual_out", res), ("norm_out", nrm)):
        nan = torch.isnan(t)
        if nan.any():
            fails.append(f"{tag}: {name} has {int(nan.sum())} unwritten/NaN elements, first at "
                         f"{nan.nonzero()[:3].tolist()}")
    bad = ~((res >= lo) & (res <= hi))
    if bad.any():
        fails.append(f"{tag}: residual_out outside the derived bracket at {int(bad.sum())}/{bad.numel()} "
                     f"elements (idx: kernel, ref, lo, hi, exact) {_first_bad(bad, res, ref_res, lo, hi, s64)}")
    # norm-relative bound: RN error (u|s| + subnormal half-spacing) plus the bracket's width
    width = torch.maximum(hi - s64, s64 - lo).clamp(min=0)
    res_l2_bound = float(u * s64.norm() + width.norm() + SUBNORMAL_SPACING[dtype] / 2 * math.sqrt(s64.numel()))
    err = float((res - s64).nan_to_num(nan=math.inf).norm())
    if not err <= res_l2_bound:
        fails.append(f"{tag}: ||residual_out - exact||_2 = {err:.6g} > derived bound {res_l2_bound:.6g}")
    stats["max_res_ulp_from_ref"] = max(stats["max_res_ulp_from_ref"],
                                        float(((res - ref_res).abs() / ulp(ref_res, dtype)).nan_to_num(0).max()))
    # norm_out against the RMSNorm of this rank's own residual_out
    y, nlo, nhi = norm_bracket(res_t.to(dev), case[0]["norm_weight"].to(dev), m["eps"], m["weight_bias"], dtype)
    nlo, nhi = nlo.to(torch.float64), nhi.to(torch.float64)
    bad = ~((nrm >= nlo) & (nrm <= nhi))
    if bad.any():
        fails.append(f"{tag}: norm_out outside the derived bracket at {int(bad.sum())}/{bad.numel()} "
                     f"elements (idx: kernel, y64, lo, hi) {_first_bad(bad, nrm, y, nlo, nhi)}")
    nb = float((u + norm_rel_bound(H)) * y.norm() + SUBNORMAL_SPACING[dtype] / 2 * math.sqrt(y.numel()))
    nerr = float((nrm - y).nan_to_num(nan=math.inf).norm())
    if not nerr <= nb:
        fails.append(f"{tag}: ||norm_out - rmsnorm64(own residual)||_2 = {nerr:.6g} > derived bound {nb:.6g}")
    if quant is None:
        return fails
    if quant in ("fp8_group128", "fp8_tensor"):
        return fails + _check_fp8(got, nrm_t.to(nvfp4_device), tag, quant, gs_val, fp8)
    q_t, s_t = got["quant_out"], got["scale_out"]
    n = scale_out_bytes(T, H)
    if q_t is None or s_t is None:
        return fails + [f"{tag}: nvfp4 outputs missing"]
    if tuple(q_t.shape) != (T, H // 2) or q_t.dtype != torch.uint8 or s_t.dtype != torch.uint8 \
            or s_t.dim() != 1 or s_t.numel() < n:
        return fails + [f"{tag}: nvfp4 output shapes quant {tuple(q_t.shape)} {q_t.dtype}, "
                        f"scale {tuple(s_t.shape)} {s_t.dtype} (need >= {n} bytes)"]
    if gs_val is None:
        return fails + [f"{tag}: no global_scale given to check NVFP4 against"]
    qref, sref = nvfp4_ref(nrm_t.to(nvfp4_device), gs_val)
    qk = q_t.to(nvfp4_device)
    sk = s_t.to(nvfp4_device)
    bad = qk != qref
    if bad.any():
        fails.append(f"{tag}: quant_out differs from nvfp4_ref(own norm_out) in {int(bad.sum())}/"
                     f"{bad.numel()} bytes (idx: kernel, ref) {_first_bad(bad, qk, qref)}")
    bad = sk[:n] != sref
    if bad.any():
        where = bad.nonzero()[:5].reshape(-1).tolist()
        fails.append(f"{tag}: scale_out differs from nvfp4_ref in {int(bad.sum())}/{n} bytes, "
                     f"at offsets {where}: kernel {sk[where].tolist()} ref {sref[where].tolist()} "
                     f"(padding bytes must be 0)")
    return fails


def _check_fp8(got, norm_out, tag, quant, scale, fp8):
    """FP8 bytes and float32 scales exactly equal to the reference rule applied to this rank's own
    norm_out (on norm_out's device); the column-major padding must be 0."""
    T, H = norm_out.shape
    q_t, s_t = got["quant_out"], got["scale_out"]
    if q_t is None or tuple(q_t.shape) != (T, H) or q_t.dtype != torch.float8_e4m3fn:
        return [f"{tag}: FP8 quant_out {None if q_t is None else (tuple(q_t.shape), q_t.dtype)}, need [{T}, {H}] "
                f"float8_e4m3fn"]
    if quant == "fp8_tensor":
        if scale is None:
            return [f"{tag}: no fp8 scale given to check against"]
        qref, sref = fp8_tensor_ref(norm_out, scale), None
    else:
        qref, sref = fp8_group_ref(norm_out, pow2_scales=fp8["pow2"], column_major=fp8["layout"] == "column")
    fails = []
    qk, qr = q_t.to(norm_out.device).view(torch.uint8), qref.view(torch.uint8)
    bad = qk != qr
    if bad.any():
        fails.append(f"{tag}: quant_out differs from the {quant} rule on own norm_out in {int(bad.sum())}/"
                     f"{bad.numel()} bytes (idx: kernel, ref) {_first_bad(bad, qk, qr)}")
    if sref is not None:
        if s_t is None or tuple(s_t.shape) != tuple(sref.shape) or s_t.dtype != torch.float32:
            return fails + [f"{tag}: FP8 scale_out {None if s_t is None else (tuple(s_t.shape), s_t.dtype)}, "
                            f"need {tuple(sref.shape)} float32 ({fp8['layout']})"]
        sk = s_t.to(norm_out.device)
        bad = sk.view(torch.int32) != sref.view(torch.int32)
        if bad.any():
            fails.append(f"{tag}: scale_out ({fp8['layout']}, pow2={fp8['pow2']}) differs from the rule in "
                         f"{int(bad.sum())}/{bad.numel()} scales (padding must be 0) (idx: kernel, ref) "
                         f"{_first_bad(bad, sk, sref)}")
    return fails


# ---- FP8 outputs for Hopper consumers (docs/operation.md, the two FP8 sections) --------------

FP8_EPS = 1e-10


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(s)) for float32 s > 0, exactly (frexp, not a rounded log2)."""
    m, e = torch.frexp(s.to(torch.float32))
    e = torch.where(m == 0.5, e - 1, e)  # s is already a power of two
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), e)


def fp8_group_ref(norm_out: torch.Tensor, *, pow2_scales: bool = False, column_major: bool = False):
    """Per-token-group FP8 E4M3 of the dtype-rounded norm_out, vLLM/SGLang per_token_group_quant_fp8
    convention, every step in float32: amax = max(max|x| over 128 elements, 1e-10); s = amax / 448;
    s = 2^ceil(log2 s) if pow2_scales; q = e4m3(clamp(x / s, -448, 448)) with round-to-nearest-even.
    Returns (q [T, H] float8_e4m3fn, scales float32): [T, H/128] row-major, or column-major
    [H/128, roundup(T, 4)] (T padded to a multiple of 4 for TMA alignment; padding 0)."""
    T, H = norm_out.shape
    if H % FP8_GROUP:
        raise ValueError(f"hidden {H} is not a multiple of {FP8_GROUP}")
    x = norm_out.to(torch.float32).reshape(T, H // FP8_GROUP, FP8_GROUP)
    amax = torch.clamp(x.abs().amax(dim=-1), min=FP8_EPS)
    # A full tensor divisor, never a 0-dim one: torch turns division by a CPU scalar into a
    # multiplication by its rounded reciprocal on the GPU, which is not the rule's division.
    s = amax / torch.full_like(amax, E4M3_MAX)
    if pow2_scales:
        s = pow2_ceil(s)
    q = e4m3_satfinite_bytes(x / s[..., None]).view(torch.float8_e4m3fn).reshape(T, H)
    if not column_major:
        return q, s
    cols = torch.zeros(fp8_scale_shape(T, H, "column"), dtype=torch.float32, device=s.device)
    cols[:, :T] = s.t()
    return q, cols


def fp8_tensor_ref(norm_out: torch.Tensor, scale: float):
    """Per-tensor FP8 E4M3 with one static float32 scale: q = e4m3(clamp(x / scale, -448, 448)), a
    NaN quotient (a NaN scale, 0 / 0) as 0x7F. Any scale follows it (dispatch/API.md's table)."""
    x = norm_out.to(torch.float32)
    s = torch.full_like(x, f32(float(scale)))  # a full tensor divisor: see fp8_group_ref
    return e4m3_satfinite_bytes(x / s).view(torch.float8_e4m3fn)


# ---- per-element tolerances for a cheap check on the device (the soak's) ---------------------
# check_outputs is exact but slow (brackets by rounding, on the host); these give, on the device
# and for every element, an expected value and a distance a correct kernel stays within.

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
