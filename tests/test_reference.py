"""CPU tests of moe_ar_tools/reference/ against independent implementations.

Every check here compares the reference with something computed another way
(exact rationals, nearest-value search over a decoded table, hand-worked bytes,
direct loops), so a wrong rounding rule, tie-break, layout or order fails.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest
import torch

from moe_ar_tools import reference as ref

BF16, FP16 = torch.bfloat16, torch.float16
# (precision bits incl. the implicit one, minimum normal exponent)
FORMATS = {"f32": (24, -126), "bf16": (8, -126), "fp16": (11, -14), "e4m3": (4, -6)}


# ---- exact rounding with rationals (independent of torch's conversions) ------------

def rn_exact(q: Fraction, fmt: str) -> Fraction:
    """Round a rational to the nearest value of fmt, ties to even; no overflow handling."""
    p, emin = FORMATS[fmt]
    if q == 0:
        return Fraction(0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    e = max(e, emin)
    quantum = Fraction(2) ** (e - p + 1)
    n = a / quantum
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    return sign * fl * quantum


def fr(x) -> Fraction:
    return Fraction(float(x))


@pytest.fixture
def rng(seed_for):
    s = seed_for("rng")
    return s, torch.Generator().manual_seed(s)


# ---- round_to_dtype -----------------------------------------------------------------

@pytest.mark.parametrize("dtype,fmt", [(BF16, "bf16"), (FP16, "fp16"), (torch.float32, "f32")])
def test_round_to_dtype_matches_exact_rounding(dtype, fmt, rng):
    seed, g = rng
    x = torch.randn(4000, generator=g, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(-20, 12, (4000,), generator=g).double())
    got = ref.round_to_dtype(x, dtype)
    for xi, gi in zip(x.tolist(), got.tolist()):
        assert fr(gi) == rn_exact(Fraction(xi), fmt), (seed, xi, gi)


@pytest.mark.parametrize("dtype,fmt", [(BF16, "bf16"), (FP16, "fp16")])
def test_round_to_dtype_single_rounding_on_double_rounding_traps(dtype, fmt, rng):
    """x = midpoint of two D values + a tiny bit below float32 resolution.

    float64 -> float32 rounds x onto the midpoint, then RNE goes to the even
    neighbour; correct single rounding goes up (x is above the midpoint). torch's
    own .to(dtype) takes the double rounding: the test shows the trap is real.
    """
    seed, g = rng
    p, _ = FORMATS[fmt]
    base = torch.rand(500, generator=g, dtype=torch.float64) * 0.9 + 1.05  # [1.05, 1.95)
    lowv = ref.round_to_dtype(base, dtype).to(torch.float64)
    q = 2.0 ** (1 - p)
    # even lower neighbour (so the tie goes down), in [1, 2)
    lowv = torch.where(((lowv / q).round() % 2) == 1, lowv - q, lowv)
    mid = lowv + q / 2
    x = mid + 2.0 ** -40  # far below float32's 2^-23 spacing at [1, 2)
    got = ref.round_to_dtype(x, dtype).to(torch.float64)
    assert torch.equal(got, lowv + q), seed
    naive = x.to(dtype).to(torch.float64)
    assert (naive == lowv).all(), "torch's float64->dtype conversion is no longer a double rounding"
    for xi, gi in zip(x.tolist()[:50], got.tolist()[:50]):
        assert Fraction(gi) == rn_exact(Fraction(xi), fmt)


# ---- E2M1 ---------------------------------------------------------------------------

def e2m1_nearest_even(v: torch.Tensor) -> torch.Tensor:
    """Independent E2M1: nearest of the 8 magnitudes (float64 distances), even code on a tie."""
    vals = torch.tensor(ref.E2M1_VALUES, dtype=torch.float64)
    mag = v.to(torch.float64).abs()
    d = (mag[:, None] - vals[None, :]).abs()
    cand = d == d.min(dim=1, keepdim=True).values
    codes = torch.arange(8)
    score = cand.to(torch.int64) * (2 - (codes % 2))[None, :]  # even candidates win
    code = score.argmax(dim=1).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def test_e2m1_tie_points_and_exact_values():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
    expect = [0, 2, 2, 4, 4, 6, 6]  # values 0, 1, 1, 2, 2, 4, 4: the even code
    assert ref.e2m1_nibbles(ties).tolist() == expect
    assert ref.e2m1_nibbles(-ties).tolist() == [c | 8 for c in expect]
    exact = torch.tensor(ref.E2M1_VALUES, dtype=torch.float32)
    assert ref.e2m1_nibbles(exact).tolist() == list(range(8))
    assert ref.e2m1_nibbles(-exact[1:]).tolist() == [8 + c for c in range(1, 8)]
    # one float32 step either side of every tie
    up = torch.nextafter(ties, torch.full_like(ties, math.inf))
    dn = torch.nextafter(ties, torch.full_like(ties, -math.inf))
    assert ref.e2m1_nibbles(up).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert ref.e2m1_nibbles(dn).tolist() == [0, 1, 2, 3, 4, 5, 6]
    # saturation
    big = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, math.inf], dtype=torch.float32)
    assert ref.e2m1_nibbles(big).tolist() == [7] * 6
    assert ref.e2m1_nibbles(-big).tolist() == [15] * 6


def test_e2m1_sign_of_zero():
    v = torch.tensor([0.0, -0.0, -1e-30, -0.1, -0.25, 0.1, 0.25, -0.2500001], dtype=torch.float32)
    assert ref.e2m1_nibbles(v).tolist() == [0x0, 0x8, 0x8, 0x8, 0x8, 0x0, 0x0, 0x9]


def test_e2m1_dense_sweep_against_nearest_search(rng):
    seed, g = rng
    parts = [
        torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(BF16).float(),
        torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(FP16).float(),
        torch.linspace(-8, 8, 2 ** 20 + 1, dtype=torch.float32),
        torch.randn(2 ** 20, generator=g) * 3,
    ]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float32)
    for _ in range(4):
        parts.append(ties)
        ties = torch.nextafter(ties, torch.full_like(ties, math.inf))
    v = torch.cat(parts)
    v = torch.cat([v, -v])
    v = v[torch.isfinite(v) & (v.abs() <= 1e6)]
    got = ref.e2m1_nibbles(v)
    want = e2m1_nearest_even(v)
    bad = got != want
    assert not bad.any(), (seed, v[bad][:10].tolist(), got[bad][:10].tolist(), want[bad][:10].tolist())


# ---- E4M3 ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def e4m3_table():
    """All 256 E4M3FN bytes decoded from the bit layout (not by torch): {byte: value}."""
    out = {}
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        if e == 15 and m == 7:
            continue  # NaN
        v = Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
        out[b] = -v if s else v
    return out


def e4m3_nearest_even_satfinite(x: float) -> int:
    tab = [(b, v) for b, v in e4m3_table().items() if b < 0x80]
    q = Fraction(x)
    if q >= 448:
        return 0x7E
    best = min(abs(v - q) for _, v in tab)
    cands = [b for b, v in tab if abs(v - q) == best]
    return min(cands, key=lambda b: (b & 1, b))  # even mantissa wins a tie


def test_e4m3_table_sanity():
    t = e4m3_table()
    assert t[0x7E] == 448 and t[0x38] == 1 and t[0x01] == Fraction(1, 512) and len(t) == 254


def test_e4m3_satfinite_rne_ties_and_overflow(rng):
    seed, g = rng
    vals = sorted(v for b, v in e4m3_table().items() if b < 0x80)
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    xs = [float(v) for v in vals] + [float(m) for m in mids]
    mids_t = torch.tensor([float(m) for m in mids], dtype=torch.float32)
    for direction in (math.inf, -math.inf):  # one float32 step off each midpoint
        xs += torch.nextafter(mids_t, torch.full_like(mids_t, direction)).tolist()
    xs += [448.0, 449.0, 463.99, 464.0, 465.0, 480.0, 1e4, 3e38]
    xs += (torch.rand(600, generator=g) * 500).tolist()
    xs += (torch.rand(300, generator=g) * 0.02).tolist()
    x = torch.tensor(xs, dtype=torch.float32)
    got = ref.e4m3_satfinite_bytes(x).tolist()
    for xi, gi in zip(x.tolist(), got):
        want = e4m3_nearest_even_satfinite(xi)
        assert gi == want, (seed, xi, hex(gi), hex(want))
        if xi < 448:
            assert Fraction(e4m3_table()[gi]) == rn_exact(Fraction(xi), "e4m3"), (xi, hex(gi))
    # the tie examples named explicitly
    tie = {float(2 ** -10): 0x00, float(3 * 2 ** -10): 0x02, 1.0625: 0x38, 1.1875: 0x3A, 432.0: 0x7E, 400.0: 0x7C, 416.0: 0x7D}
    for xi, want in tie.items():
        assert ref.e4m3_satfinite_bytes(torch.tensor([xi])).item() == want, (xi, want)


# ---- swizzle ------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,hidden", [(1, 16), (5, 2064), (128, 64), (129, 2880), (300, 7168), (257, 1040)])
def test_swizzle_bijection_and_unswizzle_inverse(tokens, hidden, rng):
    seed, g = rng
    rows, cols = -(-tokens // 128) * 128, -(-(hidden // 16) // 4) * 4
    off_full = ref.swizzle_offsets(rows, cols * 16)  # the padded grid
    assert sorted(off_full.reshape(-1).tolist()) == list(range(rows * cols))
    assert ref.scale_out_bytes(tokens, hidden) == rows * cols
    off = ref.swizzle_offsets(tokens, hidden)
    assert torch.equal(off, off_full[:tokens, : hidden // 16])
    mat = torch.randint(1, 256, (tokens, hidden // 16), generator=g, dtype=torch.uint8)
    buf = torch.zeros(rows * cols, dtype=torch.uint8)
    buf[off.reshape(-1)] = mat.reshape(-1)
    assert torch.equal(ref.unswizzle(buf, tokens, hidden), mat), seed


def test_swizzle_hand_checked_offsets():
    H = 7168  # numKTiles = 112
    off = ref.swizzle_offsets(300, H)
    assert off[0, 0] == 0 and off[1, 0] == 16 and off[32, 0] == 4 and off[0, 1] == 1
    assert off[0, 4] == 512 and off[128, 0] == 112 * 512 and off[33, 5] == 512 + 16 + 4 + 1
    assert off[127, 3] == 31 * 16 + 3 * 4 + 3 and off[299, 447] == 2 * 112 * 512 + 111 * 512 + 11 * 16 + 1 * 4 + 3


# ---- NVFP4 --------------------------------------------------------------------------

def test_nvfp4_hand_checked_block():
    # gs = 1, amax = 6 -> sf = 1 -> sf8 = 0x38, scale = 1: q = e2m1(x)
    x = [6.0, 3.0, -1.5, 0.25, 0.75, 1.25, -0.1, 5.0, 5.5, 2.5, 3.5, 1.75, 0.5, -6.0, 4.0, -0.0]
    nib = [7, 5, 0xB, 0, 2, 2, 0x8, 6, 7, 4, 6, 4, 1, 0xF, 6, 0x8]
    # a second row: gs = 1, amax = bf16(1.9) = 1.8984375 -> sf = 0.31640625 -> e4m3 0.3125 (0x2A)
    # -> scale = 1 / 0.3125 = 3.2 (float32 3.2000000476837158)
    y = [1.8984375, -0.15625, 0.078125, 0.3125, -0.46875, 1.0, 0.0, 0.5] * 2
    s32 = float(torch.tensor(1.0) / torch.tensor(0.3125))
    ynib = ref.e2m1_nibbles(torch.tensor(y) * s32).tolist()
    # by hand: 6.075->7, -0.5->9, 0.25->0 (tie), 1.0->2, -1.5->0xB, 3.2->5, 0->0, 1.6->3
    assert ynib == [7, 9, 0, 2, 0xB, 5, 0, 3] * 2
    t = torch.tensor([x, y], dtype=BF16)
    q, sb = ref.nvfp4_ref(t, 1.0)
    assert q.shape == (2, 8) and sb.shape == (128 * 4,)
    assert q[0].tolist() == [nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(8)]
    assert q[1].tolist() == [ynib[2 * i] | (ynib[2 * i + 1] << 4) for i in range(8)]
    assert sb[0].item() == 0x38 and sb[16].item() == 0x2A
    assert int((sb != 0).sum()) == 2  # padding zero
    deq = ref.nvfp4_dequant(q, sb, 1.0, 2, 16)
    assert deq[0].tolist() == [6, 3, -1.5, 0, 1, 1, -0.0, 4, 6, 2, 4, 2, 0.5, -6, 4, -0.0]


def test_nvfp4_dequant_nibble_order_sign_and_scale():
    T, H = 1, 16
    # elements 0..15: low nibble is the even element, bit 3 the sign
    codes = [1, 0x9, 2, 0xA, 7, 0xF, 0, 0x8, 3, 4, 5, 6, 0xB, 0xC, 0xD, 0xE]
    quant = torch.tensor([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(8)], dtype=torch.uint8)
    scale = torch.zeros(ref.scale_out_bytes(T, H), dtype=torch.uint8)
    scale[0] = torch.tensor([2.0]).to(torch.float8_e4m3fn).view(torch.uint8)[0]
    out = ref.nvfp4_dequant(quant, scale, 0.5, T, H)  # value * sf / gs = value * 4
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expect = [(-1 if c & 8 else 1) * e2m1[c & 7] * 4.0 for c in codes]
    assert out.shape == (1, 16)
    assert out[0].tolist() == expect
    assert math.copysign(1.0, float(out[0, 7])) == -1.0  # nibble 0x8 is -0.0


def test_nvfp4_saturation_and_zero_scale():
    # gs large: sf = gs*amax/6 > 448 saturates at 448; values then saturate at 6.
    t = torch.tensor([[100.0] + [1.0] * 15], dtype=BF16)
    q, sb = ref.nvfp4_ref(t, 1000.0)
    assert sb[0].item() == 0x7E
    # scale = 1/(448/1000) = 2.2321...: 100 -> 223 -> sat 7; 1 -> 2.232 -> 2 (code 4)
    assert q[0].tolist() == [0x47] + [0x44] * 7
    # gs tiny: sf rounds to E4M3 zero -> scale 0 -> every element is +-0, sign kept
    t = torch.tensor([[1.0, -1.0] * 8], dtype=BF16)
    q, sb = ref.nvfp4_ref(t, 1e-6)
    assert sb[0].item() == 0 and q[0].tolist() == [0x80] * 8


def test_nvfp4_fp32_steps_match_exact_arithmetic(rng):
    """sf = RN32(RN32(gs * amax) / 6), scale = RN32(1 / RN32(sf8 / gs)), q = e2m1(RN32(x * scale))."""
    seed, g = rng
    T, H = 12, 128
    x = (torch.randn(T, H, generator=g) * torch.rand(T, 1, generator=g) * 8).to(BF16)
    for gs in (448 * 6 / float(x.abs().max().float()), 37.125, float(torch.rand(1, generator=g)) * 900 + 1):
        gs = ref.f32(gs)
        xb = x.float().reshape(T, H // 16, 16)
        amax, sf, sf8, scale = ref.nvfp4_block_scales(xb, gs)
        table = e4m3_table()
        for a, s, b, sc in zip(amax.reshape(-1).tolist(), sf.reshape(-1).tolist(), sf8.reshape(-1).tolist(),
                               scale.reshape(-1).tolist()):
            want_sf = rn_exact(rn_exact(Fraction(gs) * Fraction(a), "f32") / 6, "f32")
            assert Fraction(s) == want_sf, (seed, gs, a, s)
            want_b = e4m3_nearest_even_satfinite(float(want_sf))
            assert b == want_b, (seed, gs, a, hex(b), hex(want_b))
            v = table[b]
            want_sc = 0 if v == 0 else rn_exact(1 / rn_exact(v / Fraction(gs), "f32"), "f32")
            assert Fraction(sc) == want_sc, (seed, gs, a, sc)
        q, sb = ref.nvfp4_ref(x, gs)
        # nibbles from exactly rounded products, via the independent nearest search
        prod = torch.tensor([float(rn_exact(Fraction(xi) * Fraction(si), "f32"))
                             for xi, si in zip(xb.reshape(-1).tolist(),
                                               scale[..., None].expand_as(xb).reshape(-1).tolist())],
                            dtype=torch.float32)
        # exact product of a -0.0 keeps its sign; Fraction loses it: restore from x
        prod = torch.where(torch.signbit(xb.reshape(-1)) & (prod == 0), -prod, prod)
        nib = e2m1_nearest_even(prod).reshape(T, H)
        assert torch.equal(q, nib[:, 0::2] | (nib[:, 1::2] << 4)), (seed, gs)
        assert torch.equal(ref.unswizzle(sb, T, H), sf8), (seed, gs)
        assert (sb.numel() == 128 * 8) and int((sb != 0).sum()) <= T * H // 16


def test_nvfp4_padding_zero_and_rows_not_multiple_of_128(rng):
    seed, g = rng
    T, H = 131, 2064  # 129 scale columns -> padded to 132; rows padded to 256
    x = (torch.randn(T, H, generator=g) * 2).to(FP16)
    q, sb = ref.nvfp4_ref(x, ref.typical_global_scale(x))
    assert sb.numel() == 256 * 132
    mask = torch.zeros(256 * 132, dtype=torch.bool)
    mask[ref.swizzle_offsets(T, H).reshape(-1)] = True
    assert (sb[~mask] == 0).all()
    assert (sb[mask] != 0).all(), seed  # random non-zero blocks have non-zero scales
    deq = ref.nvfp4_dequant(q, sb, ref.typical_global_scale(x), T, H)
    rel = ((deq - x.float()).norm() / x.float().norm()).item()
    assert rel < 0.2, (seed, rel)  # 3-bit significands: sanity that the layout decodes


# ---- the op reference ---------------------------------------------------------------

def loop_reference(case):
    """Direct loops with exact rationals and exact roundings (tiny cases only)."""
    m = case.meta
    fmt = ref.dtype_name(m["dtype"])
    T, H, K = m["tokens"], m["hidden"], m["top_k"]
    rsf = Fraction(ref.f32(m["rsf"]))
    partials = []
    for kw in case:
        x = kw["allreduce_in"].double().tolist()
        idx = kw["expanded_idx_to_permuted_idx"].tolist()
        sc = kw["expert_scale_factor"]
        sc = None if sc is None else sc.double().tolist()
        sh = kw["shared_expert_output"]
        sh = None if sh is None else sh.double().tolist()
        p = [[None] * H for _ in range(T)]
        for t in range(T):
            for h in range(H):
                acc = Fraction(0)
                for k in range(K):
                    if idx[t][k] < 0:
                        continue
                    w = Fraction(1) if sc is None else Fraction(sc[t][k])
                    acc += w * Fraction(x[idx[t][k]][h])
                acc *= rsf
                if sh is not None:
                    acc += Fraction(sh[t][h])
                p[t][h] = rn_exact(acc, fmt)
        partials.append(p)
    res_in = case[0]["residual_in"].double().tolist()
    gam = case[0]["norm_weight"].double().tolist()
    eps = Fraction(ref.f32(m["eps"]))
    res = [[rn_exact(sum(p[t][h] for p in partials) + Fraction(res_in[t][h]), fmt) for h in range(H)]
           for t in range(T)]
    nrm = []
    for t in range(T):
        ms = sum(v * v for v in res[t]) / H + eps
        inv = Fraction(1.0 / math.sqrt(float(ms)))  # float64 sqrt: the reference's precision
        nrm.append([rn_exact(res[t][h] * inv * (Fraction(gam[h]) + m["weight_bias"]), fmt) for h in range(H)])
    return res, nrm


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("scale_kind,shared,wb,rsf", [("fp32", True, 1, 1.7), (None, False, 0, 1.0),
                                                      ("dtype", True, 0, 0.61)])
def test_reference_equals_direct_loops(dtype, scale_kind, shared, wb, rsf, seed_for):
    seed = seed_for("case")
    case = make_small(seed, dtype, scale_kind=scale_kind, shared=shared, weight_bias=wb, rsf=rsf)
    got = ref.reference_for(case)
    res, nrm = loop_reference(case)
    assert got["residual_out"].dtype == dtype and got["norm_out"].dtype == dtype
    assert [[fr(v) for v in row] for row in got["residual_out"].tolist()] == res, case.describe()
    assert [[fr(v) for v in row] for row in got["norm_out"].tolist()] == nrm, case.describe()
    for p in got["partials"]:
        assert p.dtype == dtype
    assert torch.equal(got["residual_out"], ref.round_to_dtype(got["residual_out_f64"], dtype))
    assert (got["residual_lo"] <= got["residual_out"]).all() and (got["residual_out"] <= got["residual_hi"]).all()


def make_small(seed, dtype, **kw):
    return ref.make_case(3, 5, 32, 3, dtype, padded_rows=4, drop_frac=0.3, seed=seed, **kw)


def test_partials_are_rounded_to_dtype_before_the_sum(seed_for):
    """Skipping the per-rank rounding changes residual_out somewhere (the test has teeth)."""
    seed = seed_for("case")
    case = ref.make_case(4, 16, 256, 4, BF16, seed=seed)
    got = ref.reference_for(case)
    unrounded = sum(ref.finalize_partial(kw["allreduce_in"], kw["expanded_idx_to_permuted_idx"],
                                         kw["expert_scale_factor"], case.meta["rsf"], kw["shared_expert_output"])
                    for kw in case) + case[0]["residual_in"].double()
    assert not torch.equal(ref.round_to_dtype(unrounded, BF16), got["residual_out"]), seed


# ---- the kernel bracket: admits float32 kernels, rejects other rounding --------------

def simulate_fp32_kernel(case, *, rank_order=None, per_op_rounding=False, eps=None, weight_bias=None):
    """An emulation of a kernel: partials accumulated in float32 (or rounded to D after
    every op, the TensorRT-LLM way), summed in float32 in rank_order, norm in float32."""
    m = case.meta
    D = m["dtype"]
    acc_t = D if per_op_rounding else torch.float32
    eps = m["eps"] if eps is None else eps
    wb = m["weight_bias"] if weight_bias is None else weight_bias
    parts = []
    for kw in case:
        idx = kw["expanded_idx_to_permuted_idx"].long()
        T, K = idx.shape
        acc = torch.zeros(T, m["hidden"], dtype=acc_t)
        for k in range(K):
            valid = (idx[:, k] >= 0)[:, None]
            rows = kw["allreduce_in"][idx[:, k].clamp(min=0)].to(acc_t)
            w = kw["expert_scale_factor"]
            w = torch.ones(T, dtype=acc_t) if w is None else w[:, k].to(acc_t)
            acc = torch.where(valid, acc + w[:, None] * rows, acc)
        acc = acc * torch.tensor(m["rsf"], dtype=acc_t)
        if kw["shared_expert_output"] is not None:
            acc = acc + kw["shared_expert_output"].to(acc_t)
        parts.append(acc.to(D))
    s = torch.zeros_like(parts[0], dtype=acc_t)
    for r in (rank_order or range(len(parts))):
        s = s + parts[r].to(acc_t)
    res = (s + case[0]["residual_in"].to(acc_t)).to(D)
    x = res.float()
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + ref.f32(eps))
    nrm = (x * r * (case[0]["norm_weight"].float() + wb)).to(D)
    return res, nrm


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_bracket_admits_fp32_kernels_and_rejects_per_op_rounding(dtype, seed_for):
    seed = seed_for("case")
    case = ref.make_case(4, 32, 512, 6, dtype, scale_kind="fp32", shared=True, rsf=2.5, seed=seed)
    got = ref.reference_for(case)
    lo, hi = got["residual_lo"], got["residual_hi"]
    for order in (None, list(reversed(range(4)))):
        res, nrm = simulate_fp32_kernel(case, rank_order=order)
        assert ((lo <= res) & (res <= hi)).all(), seed
        _, nlo, nhi = ref.norm_bracket(res, case[0]["norm_weight"], case.meta["eps"], case.meta["weight_bias"], dtype)
        assert ((nlo <= nrm) & (nrm <= nhi)).all(), seed
    res, _ = simulate_fp32_kernel(case, per_op_rounding=True)
    outside = ~((lo <= res) & (res <= hi))
    assert outside.sum() > 0, seed
    # norm with the wrong eps or without weight_bias leaves the norm bracket
    res, _ = simulate_fp32_kernel(case)
    _, nlo, nhi = ref.norm_bracket(res, case[0]["norm_weight"], case.meta["eps"], case.meta["weight_bias"], dtype)
    for kw in (dict(eps=1e-1), dict(weight_bias=1)):
        _, nrm = simulate_fp32_kernel(case, **kw)
        assert (~((nlo <= nrm) & (nrm <= nhi))).any(), (seed, kw)


def test_check_outputs_accepts_reference_and_catches_faults(seed_for):
    from collections import namedtuple
    Out = namedtuple("Out", "norm_out residual_out quant_out scale_out")
    seed = seed_for("case")
    case = ref.make_case(2, 130, 80, 4, BF16, seed=seed)  # 5 scale columns (padded to 8), 2 row tiles
    r = ref.reference_for(case)
    gs = ref.typical_global_scale(r["norm_out"])
    q, sb = ref.nvfp4_ref(r["norm_out"], gs)
    prov = ref.alloc_outputs(case, "nvfp4", extra_scale_bytes=32)
    for p in prov:
        p["residual_out"].copy_(r["residual_out"])
        p["norm_out"].copy_(r["norm_out"])
        p["quant_out"].copy_(q)
        p["scale_out"][: sb.numel()].copy_(sb)
    outs = [Out(p["norm_out"], p["residual_out"], p["quant_out"], p["scale_out"]) for p in prov]
    ref.check_outputs(case, outs, prov, quant="nvfp4", global_scale=gs, ref=r)
    # one-ulp faults where the bracket is a single value
    i_res = int((r["residual_lo"] == r["residual_hi"]).reshape(-1).nonzero()[0])
    _, nlo, nhi = ref.norm_bracket(r["residual_out"], case[0]["norm_weight"], case.meta["eps"],
                                   case.meta["weight_bias"], BF16)
    i_nrm = int((nlo == nhi).reshape(-1).nonzero()[0])

    def one_ulp_up(t, i):
        v = t.view(-1)[i].double()
        t.view(-1)[i] = ref.round_to_dtype(v + ref.ulp(v, BF16), BF16)

    # (message expected when the fault is on every rank, the fault)
    faults = [
        ("residual_out has 1 unwritten", lambda p: p["residual_out"].view(-1).__setitem__(7, math.nan)),
        ("residual_out outside the derived bracket", lambda p: one_ulp_up(p["residual_out"], i_res)),
        ("norm_out outside the derived bracket", lambda p: one_ulp_up(p["norm_out"], i_nrm)),
        ("quant_out differs", lambda p: p["quant_out"].view(-1).__setitem__(5, p["quant_out"].view(-1)[5] ^ 1)),
        ("scale_out differs", lambda p: p["scale_out"].__setitem__(sb.numel() - 1, 3)),  # a padding byte
        ("past the", lambda p: p["scale_out"].__setitem__(sb.numel() + 2, 0)),
    ]
    for needle, fault in faults:
        for ranks, expect in (([1], needle if needle == "past the" else "not bit-identical"), ([0, 1], needle)):
            prov2 = [{k: v.clone() for k, v in p.items()} for p in prov]
            for rank in ranks:
                fault(prov2[rank])
            outs2 = [Out(p["norm_out"], p["residual_out"], p["quant_out"], p["scale_out"]) for p in prov2]
            with pytest.raises(AssertionError, match=expect):
                ref.check_outputs(case, outs2, prov2, quant="nvfp4", global_scale=gs, ref=r)
            if ranks == [1]:  # the differing rank is checked in full as well
                with pytest.raises(AssertionError, match=needle):
                    ref.check_outputs(case, outs2, prov2, quant="nvfp4", global_scale=gs, ref=r)


# ---- make_case ----------------------------------------------------------------------

def test_make_case_structure(seed_for):
    seed = seed_for("case")
    W, T, H, K, pad = 4, 33, 128, 6, 17
    case = ref.make_case(W, T, H, K, FP16, padded_rows=pad, drop_frac=0.25, scale_kind="dtype", seed=seed)
    assert len(case) == W and case.seed == seed
    idx = case[0]["expanded_idx_to_permuted_idx"]
    assert idx.dtype == torch.int32 and idx.shape == (T, K)
    valid = idx[idx >= 0]
    assert valid.unique().numel() == valid.numel() and int(valid.max()) < T * K + pad
    assert 0 < int((idx < 0).sum()) < T * K
    for r, kw in enumerate(case):
        assert kw["allreduce_in"].shape == (T * K + pad, H) and kw["allreduce_in"].dtype == FP16
        used = kw["allreduce_in"][valid.long()]
        assert torch.isfinite(used).all() and (used != 0).float().mean() > 0.99
        assert torch.isnan(kw["allreduce_in"]).any()  # unreferenced rows are poisoned
        assert kw["expert_scale_factor"].dtype == FP16 and (kw["expert_scale_factor"] > 0).all()
        assert torch.equal(kw["expanded_idx_to_permuted_idx"], idx)
        assert torch.equal(kw["residual_in"], case[0]["residual_in"])
        assert torch.equal(kw["norm_weight"], case[0]["norm_weight"])
        if r:
            assert kw["residual_in"].data_ptr() != case[0]["residual_in"].data_ptr()
            assert not torch.equal(kw["shared_expert_output"], case[0]["shared_expert_output"])
            assert not torch.equal(kw["allreduce_in"][valid.long()], case[0]["allreduce_in"][valid.long()])
    assert (case[0]["norm_weight"].float() - 1).abs().mean() < 0.2
    again = ref.make_case(W, T, H, K, FP16, padded_rows=pad, drop_frac=0.25, scale_kind="dtype", seed=seed)
    assert all(torch.equal(a["allreduce_in"].view(torch.int16), b["allreduce_in"].view(torch.int16))
               for a, b in zip(case, again))
    other = ref.make_case(W, T, H, K, FP16, padded_rows=pad, drop_frac=0.25, scale_kind="dtype", seed=seed + 1)
    assert not torch.equal(other[0]["residual_in"], case[0]["residual_in"])
    none = ref.make_case(2, 3, 32, 1, BF16, scale_kind=None, shared=False)
    assert none[0]["expert_scale_factor"] is None and none[0]["shared_expert_output"] is None
    assert isinstance(none.seed, int)


def test_ulp_helper():
    x = torch.tensor([1.0, 1.5, 2.0, 1e-6, 0.0, -3.0], dtype=torch.float64)
    assert ref.ulp(x, BF16).tolist() == [2 ** -7, 2 ** -7, 2 ** -6, 2 ** -27, 2 ** -133, 2 ** -6]
    assert ref.ulp(x, FP16).tolist() == [2 ** -10, 2 ** -10, 2 ** -9, 2 ** -24, 2 ** -24, 2 ** -9]


# ---- FP8 output references (issue 6) -----------------------------------------------------------

def _activations(T, H, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g) * torch.rand(T, 1, generator=g) * 4).to(torch.bfloat16)


def test_pow2_ceil_is_exact():
    s = torch.tensor([0.5, 0.75, 1.0, 1.0000001, 3.0, 2.0 ** -20, 2.0 ** -20 * 1.5, 448.0], dtype=torch.float32)
    assert ref.pow2_ceil(s).tolist() == [0.5, 1.0, 1.0, 2.0, 4.0, 2.0 ** -20, 2.0 ** -19, 512.0]


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_group_ref_scales_and_bounds(pow2):
    T, H = 7, 512
    x = _activations(T, H, 11)
    q, s = ref.fp8_group_ref(x, pow2_scales=pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, H) and s.shape == (T, H // 128)
    xf = x.float().reshape(T, H // 128, 128)
    amax = xf.abs().amax(-1)
    qf = q.float().reshape(T, H // 128, 128)
    assert (qf.abs() <= 448).all()
    if not pow2:
        # the group's largest element lands on +-448 (x / (amax / 448) is 448 to within an ulp)
        assert torch.equal(qf.abs().amax(-1), torch.full_like(amax, 448.0))
    else:
        assert torch.equal(ref.pow2_ceil(s), s) and (s >= amax / 448).all() and (s < 2 * amax / 448).all()
    # dequantized values are within half an E4M3 step (3 mantissa bits) of x, or of the
    # subnormal spacing 2^-9 times the scale
    err = (qf * s[..., None] - xf).abs()
    assert (err <= torch.maximum(xf.abs() * 2.0 ** -4, s[..., None] * 2.0 ** -10) * (1 + 1e-6)).all()


def _divisions_are_correctly_rounded(device):
    """The FP8 references divide as the rule says, x / s correctly rounded in float32: for float32
    operands that is the float64 quotient rounded to float32 (53 >= 2 * 24 + 2 bits)."""
    x = _activations(64, 1024, 13).to(device)
    _, s = ref.fp8_group_ref(x)
    amax = x.float().reshape(64, 8, 128).abs().amax(-1).clamp(min=ref.FP8_EPS)
    assert torch.equal(s, (amax.double() / 448.0).float())
    scale = ref.f32(0.0123)
    q = ref.fp8_tensor_ref(x, scale)
    exact = (x.double() / scale).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), exact.view(torch.uint8))


def test_fp8_refs_divide_correctly_rounded_on_cpu():
    _divisions_are_correctly_rounded("cpu")


@pytest.mark.gpu
def test_fp8_refs_divide_correctly_rounded_on_gpu():
    """torch divides by a 0-dim CPU tensor as a multiplication by its reciprocal on the GPU; the
    references must not (a first version did, and the kernel's exact division looked wrong)."""
    _divisions_are_correctly_rounded("cuda")


def test_fp8_group_ref_column_major_is_the_transpose_padded_to_4():
    x = _activations(5, 256, 12)
    q_r, s_r = ref.fp8_group_ref(x)
    q_c, s_c = ref.fp8_group_ref(x, column_major=True)
    assert torch.equal(q_r.view(torch.uint8), q_c.view(torch.uint8))
    assert s_c.shape == (2, 8) and torch.equal(s_c[:, :5], s_r.t()) and (s_c[:, 5:] == 0).all()


def test_fp8_group_ref_all_zero_group_uses_eps_and_keeps_sign():
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 3] = -0.0
    q, s = ref.fp8_group_ref(x)
    assert s.item() == pytest.approx(1e-10 / 448, rel=1e-6)
    assert (q.float() == 0).all() and torch.signbit(q.float()[0, 3])


def test_fp8_tensor_ref_saturates_and_rounds_to_nearest_even():
    # 448 is the largest E4M3; between 256 and 448 the step is 32, so 272 is a tie (-> 256, even)
    x = torch.tensor([[1000.0, -1000.0, 272.0, 288.0, 1.0]], dtype=torch.float32)
    q = ref.fp8_tensor_ref(x, 1.0).float()
    assert q.tolist() == [[448.0, -448.0, 256.0, 288.0, 1.0]]
    # scale 2: 136 is a tie between 128 and 144 (step 16) -> 128, the even mantissa
    assert ref.fp8_tensor_ref(x, 2.0).float().tolist() == [[448.0, -448.0, 128.0, 144.0, 0.5]]
