"""The strongest hand-written baselines of the world-size-1 tail, in Triton, as an engine builder
would write them in an afternoon:

* `fused`: the whole tail in one launch, one program a token. The token's K route rows are loaded
  in an unrolled loop (every load in flight before the first sum), summed in fp32 with the router
  weights, times routed_scaling_factor, plus the shared expert's row and the residual; residual_out
  rounded once; the block-wide sum of squares; the normalized row, and its FP8 per-token-group-128
  (row-major scales) or per-tensor quantization.
* `chain`: the engines' two-kernel path: a gather-weighted-sum kernel (routes + shared) to a [T, H]
  partial in the dtype, then a fused add + RMSNorm (+ FP8) kernel, in Triton; the benchmark uses
  FlashInfer's CUDA norm kernels for the second step where they run (moe_ar_tools.baselines.flashinfer_norm).

Both take `num_warps` as their launch parameter; the benchmark sweeps it per token count and keeps the
fastest (NUM_WARPS). Divisions are correctly rounded (div_rn), so the FP8 bytes follow the rule of
docs/operation.md applied to each baseline's own norm_out; the sum of squares is Triton's tree.
Triton is imported on first use: the module imports without it (the CPU tests run the kernels in
Triton's interpreter where Triton is installed).
"""
from __future__ import annotations

from typing import Optional

NUM_WARPS = (4, 8, 16, 32)  # the launch parameters a sweep tries (one program a token)
FP8_GROUP = 128
E4M3_MAX = 448.0
FP8_EPS = 1e-10
QUANTS = (None, "fp8_group128", "fp8_tensor")  # what `fused` and `chain` write besides the plain outputs
_QUANT_CODE = {None: 0, "fp8_group128": 1, "fp8_tensor": 2}


def _kernels():
    from moe_ar_tools.baselines import triton_kernels  # imports Triton
    return {"fused": triton_kernels.fused, "gather_sum": triton_kernels.gather_sum,
            "add_rmsnorm": triton_kernels.add_rmsnorm}


def unsupported(quant: Optional[str], scale_layout: Optional[str], device) -> Optional[str]:
    """Why the Triton baselines cannot run a profile on `device` (None: they can)."""
    if getattr(device, "type", str(device)) != "cuda":
        return "Triton baselines: need a CUDA device"
    if quant == "nvfp4":
        return "Triton baselines: no NVFP4 output"
    if quant == "fp8_group128" and scale_layout not in (None, "row"):
        return "Triton baselines: FP8 group-128 scales row-major only"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton not installed ({e})"
    return None


def _block(hidden: int) -> int:
    """The row as one power-of-two block (masked past H)."""
    return max(FP8_GROUP, 1 << (hidden - 1).bit_length())


def _check(quant: Optional[str], hidden: int) -> None:
    if quant not in _QUANT_CODE:
        raise ValueError(f"quant: {quant!r}, the Triton baselines write {', '.join(map(str, QUANTS))}")
    if quant == "fp8_group128" and hidden % FP8_GROUP:
        raise ValueError(f"hidden: {hidden} is not a multiple of {FP8_GROUP} (FP8 group-128)")


def outputs(tokens: int, hidden: int, dtype, quant: Optional[str], device) -> dict:
    """Preallocated outputs of one call: residual_out, norm_out and the quantized ones."""
    import torch
    _check(quant, hidden)
    outs = {"residual_out": torch.empty(tokens, hidden, dtype=dtype, device=device),
            "norm_out": torch.empty(tokens, hidden, dtype=dtype, device=device)}
    if quant is not None:
        outs["quant_out"] = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device)
    if quant == "fp8_group128":
        outs["scale_out"] = torch.empty(tokens, hidden // FP8_GROUP, dtype=torch.float32, device=device)
    return outs


def _quant_args(outs: dict, quant: Optional[str], fp8_scale):
    q = outs.get("quant_out")
    s = outs.get("scale_out")
    dummy = outs["norm_out"]  # never written when the kernel does not quantize
    return (q if q is not None else dummy, s if s is not None else dummy,
            fp8_scale if quant == "fp8_tensor" else dummy)


def fused(outs: dict, allreduce_in, idx, scale, shared, residual_in, norm_weight, *, eps: float,
          routed_scaling_factor: float = 1.0, weight_bias: float = 0.0, quant: Optional[str] = None,
          fp8_scale=None, num_warps: int = 8) -> dict:
    """The one-launch tail into `outs` (outputs()); returns outs."""
    T, K = idx.shape
    H = allreduce_in.shape[1]
    _check(quant, H)
    if T == 0:
        return outs
    q, s, qs = _quant_args(outs, quant, fp8_scale)
    _kernels()["fused"][(T,)](
        allreduce_in, idx, scale if scale is not None else idx, shared if shared is not None else residual_in,
        residual_in, norm_weight, outs["residual_out"], outs["norm_out"], q, s, qs, allreduce_in.shape[0], H,
        float(routed_scaling_factor), float(eps), float(weight_bias), K=K, HAS_W=scale is not None,
        HAS_SHARED=shared is not None, QUANT=_QUANT_CODE[quant], BLOCK=_block(H), GROUP=FP8_GROUP,
        num_warps=num_warps)
    return outs


def gather_sum(partial, allreduce_in, idx, scale, shared, *, routed_scaling_factor: float = 1.0,
               num_warps: int = 8):
    """partial [T, H] (dtype) = rsf * sum_k scale * allreduce_in[idx] + shared: the chain's first kernel."""
    T, K = idx.shape
    H = allreduce_in.shape[1]
    if T:
        _kernels()["gather_sum"][(T,)](
            allreduce_in, idx, scale if scale is not None else idx, shared if shared is not None else partial,
            partial, allreduce_in.shape[0], H, float(routed_scaling_factor), K=K, HAS_W=scale is not None,
            HAS_SHARED=shared is not None, BLOCK=_block(H), num_warps=num_warps)
    return partial


def add_rmsnorm(outs: dict, partial, residual_in, norm_weight, *, eps: float, weight_bias: float = 0.0,
                quant: Optional[str] = None, fp8_scale=None, num_warps: int = 8) -> dict:
    """residual_out = partial + residual_in (rounded once), its RMSNorm and quantization: the chain's
    second kernel, into `outs`."""
    T, H = partial.shape
    _check(quant, H)
    if T:
        q, s, qs = _quant_args(outs, quant, fp8_scale)
        _kernels()["add_rmsnorm"][(T,)](
            partial, residual_in, norm_weight, outs["residual_out"], outs["norm_out"], q, s, qs, H, float(eps),
            float(weight_bias), QUANT=_QUANT_CODE[quant], BLOCK=_block(H), GROUP=FP8_GROUP, num_warps=num_warps)
    return outs
