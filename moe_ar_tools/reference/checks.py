"""Outputs and their checks: preallocated poisoned outputs, and check_outputs, which holds every
rank's outputs to the contract's brackets, bit identity across ranks and the quantization rules."""
from __future__ import annotations

import math

import torch

from dispatch.op import fp8_scale_shape, scale_out_bytes
from moe_ar_tools.reference.cases import Case, reference_for
from moe_ar_tools.reference.contract import norm_bracket, norm_rel_bound
from moe_ar_tools.reference.quant import _gs_float, fp8_group_ref, fp8_tensor_ref, nvfp4_ref
from moe_ar_tools.reference.rounding import SUBNORMAL_SPACING, UNIT_ROUNDOFF, as_torch_dtype


POISON_BYTE = 0xAB
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
