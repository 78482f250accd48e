"""The FP8 outputs feed a real consumer (issue 6).

For each FP8 profile, one fused call on an emulated world, then:
  * dequantize quant_out with its scales and compare with the kernel's own norm_out (E4M3 keeps
    3 mantissa bits: every element within half a step, 2^-4 relative, of its value, or of the
    smallest step where it underflows);
  * quantize the same norm_out separately in torch, the way engines do today
    (per_token_group_quant_fp8 / static per-tensor quant: moe_ar_tools/reference/quant.py), and run the same
    block-FP8 GEMM on both: torch._scaled_mm with 1x128 block scales where this torch and GPU
    offer it, otherwise the same GEMM built from row-wise scaled FP8 GEMMs, one per 128-wide K
    group, summed in float32. Both must give bit-identical results, close to the bf16 GEMM of
    norm_out;
  * the bench's separate quantization kernel (the auto+quant baseline) writes the same bytes.
"""
from __future__ import annotations

import pytest
import torch

from moe_ar_tools import reference as ref

pytestmark = pytest.mark.gpu

H, T, N = 7168, 208, 512  # T, N multiples of 16 as _scaled_mm wants


def _run_fused(quant, seed, **fp8):
    import dispatch
    world = dispatch.EmulatedWorld(2, 256, H, torch.bfloat16, timeout_s=10.0)
    try:
        case = ref.make_case(2, T, H, 8, torch.bfloat16, seed=seed, device="cuda", shared=True, rsf=2.5)
        kws = [dict(kw, quant=quant, **fp8) for kw in case]
        scale = None
        if quant == "fp8_tensor":
            amax = float(ref.reference_for(case)["norm_out"].abs().max())
            scale = ref.f32(amax / ref.E4M3_MAX)
            for kw in kws:
                kw["fp8_scale"] = torch.tensor([scale], dtype=torch.float32, device="cuda")
        outs = world.run(kws)
        torch.cuda.synchronize()
        world.check()
        return outs[0], scale
    finally:
        world.close()


def _weights(seed):
    """A bf16 weight [N, H] and its block-FP8 form with one float32 scale per 128x128 block, as
    DeepSeek-V3-style FP8 checkpoints store them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(N, H, generator=g) * 0.05).to(torch.bfloat16).cuda()
    blocks = w.float().view(N // 128, 128, H // 128, 128)
    w_bs = (blocks.abs().amax(dim=(1, 3)) / ref.E4M3_MAX).clamp(min=1e-12)  # [N/128, H/128]
    w_q = (blocks / w_bs[:, None, :, None]).clamp(-ref.E4M3_MAX, ref.E4M3_MAX).view(N, H).to(torch.float8_e4m3fn)
    return w, w_q, w_bs


def _per_group_gemm(q, s_rows, w_q, w_bs):
    """The block-FP8 GEMM from row-wise scaled FP8 GEMMs: for each 128-wide K group g,
    _scaled_mm(q[:, g], w_q[:, g]^T, scale_a = s_rows[:, g], scale_b = w_bs[n / 128, g]), summed in
    float32."""
    out = torch.zeros(q.shape[0], w_q.shape[0], dtype=torch.float32, device=q.device)
    for g in range(H // 128):
        a = q[:, g * 128:(g + 1) * 128].contiguous()
        b = w_q[:, g * 128:(g + 1) * 128].contiguous().t()
        sb = w_bs[:, g].repeat_interleave(128)[None, :].contiguous()
        out += torch._scaled_mm(a, b, scale_a=s_rows[:, g:g + 1].contiguous(), scale_b=sb,
                                out_dtype=torch.bfloat16).float()
    return out


def _blockwise_gemm(q, s_rows, w_q, w_bs):
    """torch._scaled_mm with 1x128 activation and 128x128 weight block scales, or None where this
    torch / GPU does not offer it. Scales are passed "outer-dim major" (column-major), as
    DeepGEMM-style consumers read them."""
    try:
        sa = s_rows.t().contiguous().t()          # [T, H/128], stride (1, T)
        sb = w_bs.contiguous().t()                # [H/128, N/128] view of the [N/128, H/128] blocks
        return torch._scaled_mm(q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None


def _group_gemm(q, s_rows, w_q, w_bs, exact):
    """The block-FP8 GEMM: torch's block-wise _scaled_mm when it runs and agrees with the exact
    product, else the per-group construction. Returns (result, which path ran)."""
    out = _blockwise_gemm(q, s_rows, w_q, w_bs)
    if out is not None and float((out.double() - exact).norm() / exact.norm()) < 0.05:
        return out, "torch._scaled_mm block-wise (1x128 x 128x128)"
    return _per_group_gemm(q, s_rows, w_q, w_bs), "row-wise torch._scaled_mm per 128-wide K group"


def _dequant_bound(x, scale):
    """|q * scale - x| for q = e4m3(fl(x / scale)), float64: half an E4M3 step at |x| / scale (3
    mantissa bits; half the subnormal step below 2^-6), plus the float32 rounding of x / scale
    (2^-24 relative), which can tip a near-tie."""
    x, scale = x.double(), scale.double() if isinstance(scale, torch.Tensor) else scale
    mag = (x.abs() / scale).clamp(min=2.0 ** -6)
    return 0.5 * 2.0 ** (torch.floor(torch.log2(mag)) - 3) * scale + x.abs() * 2.0 ** -23


@pytest.mark.parametrize("layout", ["row", "column"])
def test_fp8_group128_feeds_a_block_fp8_gemm(layout, seed_for, record_result):
    out, _ = _run_fused("fp8_group128", seed_for("case"), fp8_scale_layout=layout)
    x = out.norm_out.float()
    s = out.scale_out if layout == "row" else out.scale_out.t()[:T]
    q = out.quant_out
    # dequantize: within half an E4M3 step of norm_out
    deq = q.double() * s.repeat_interleave(128, dim=1).double()
    bound = _dequant_bound(x, s.repeat_interleave(128, dim=1))
    assert bool(((deq - x.double()).abs() <= bound).all())
    # torch's own per-token-group quantization of the same norm_out: same bytes, same scales
    q_t, s_t = ref.fp8_group_ref(out.norm_out)
    assert torch.equal(q.view(torch.uint8), q_t.view(torch.uint8))
    assert torch.equal(s.contiguous(), s_t)
    w, w_q, w_bs = _weights(seed_for("w"))
    exact = out.norm_out.double() @ w.double().t()
    ours, path = _group_gemm(q, s.contiguous(), w_q, w_bs, exact)
    theirs, path_t = _group_gemm(q_t, s_t, w_q, w_bs, exact)
    assert path == path_t and torch.equal(ours, theirs), path
    rel = float((ours.double() - exact).norm() / exact.norm())
    assert rel < 0.05, rel
    record_result(profile="fp8_group128", layout=layout, gemm=path, rel_err_vs_bf16_gemm=rel, passed=True)


def test_fp8_tensor_feeds_a_scaled_mm(seed_for, record_result):
    out, scale = _run_fused("fp8_tensor", seed_for("case"))
    x = out.norm_out.float()
    q = out.quant_out
    deq = q.double() * scale
    assert bool(((deq - x.double()).abs() <= _dequant_bound(x, torch.full_like(x, scale))).all())
    q_t = ref.fp8_tensor_ref(out.norm_out, scale)
    assert torch.equal(q.view(torch.uint8), q_t.view(torch.uint8))
    w = (torch.randn(N, H, generator=torch.Generator().manual_seed(seed_for("w"))) * 0.05).to(torch.bfloat16).cuda()
    w_scale = (w.float().abs().amax(dim=1) / ref.E4M3_MAX).clamp(min=1e-12)  # per output channel
    w_q = (w.float() / w_scale[:, None]).clamp(-ref.E4M3_MAX, ref.E4M3_MAX).to(torch.float8_e4m3fn)
    sa = torch.full((T, 1), scale, dtype=torch.float32, device="cuda")
    sb = w_scale[None, :].contiguous()
    ours = torch._scaled_mm(q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    theirs = torch._scaled_mm(q_t, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert torch.equal(ours, theirs)
    exact = out.norm_out.double() @ w.double().t()
    rel = float((ours.double() - exact).norm() / exact.norm())
    assert rel < 0.05, rel
    record_result(profile="fp8_tensor", gemm="row-wise torch._scaled_mm", rel_err_vs_bf16_gemm=rel, passed=True)


@pytest.mark.parametrize("quant", ["fp8_group128", "fp8_tensor"])
def test_bench_separate_quant_kernel_matches_the_rule(quant, seed_for):
    """The auto+quant baseline's separate kernel writes exactly the reference bytes."""
    from moe_ar_tools.bench.multi_gpu.fp8_quant import Fp8QuantKernel
    g = torch.Generator(device="cpu").manual_seed(seed_for("x"))
    x = (torch.randn(T, H, generator=g) * torch.rand(T, 1, generator=g) * 3).to(torch.bfloat16).cuda()
    kernel = Fp8QuantKernel(torch.cuda.current_device())
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device="cuda")
    if quant == "fp8_group128":
        s = torch.empty(T, H // 128, dtype=torch.float32, device="cuda")
        kernel(x, q, s, None)
        torch.cuda.synchronize()
        q_t, s_t = ref.fp8_group_ref(x)
        assert torch.equal(q.view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(s, s_t)
    else:
        scale = ref.f32(float(x.abs().max()) / 448 / 1.7)
        kernel(x, q, None, torch.tensor([scale], dtype=torch.float32, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(q.view(torch.uint8), ref.fp8_tensor_ref(x, scale).view(torch.uint8))
