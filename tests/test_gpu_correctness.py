"""Every generated program against the float64 reference, in an emulated world (all ranks in this
process, co-resident on one GPU, or spread over two GPUs when there are two).

What is checked on every call (moe_ar_tools/reference/checks.py: check_outputs):
  * every output element written (outputs are poisoned first: NaN, 0xAB bytes);
  * residual_out inside the per-element bracket derived from the precision contract
    (float32 accumulation, one rounding per rank partial, one for the sum), and a
    norm-relative bound; norm_out inside the bracket of the RMSNorm of the kernel's own
    residual_out (float32 sums, rsqrtf), and a norm-relative bound;
  * outputs bit-identical across ranks;
  * NVFP4: quant_out and scale_out bytes exactly equal to nvfp4_ref(kernel's norm_out),
    scale padding zero, and bytes past the required scale length left untouched;
  * FP8 (fp8_group128 in row- and column-major layouts, with and without power-of-two scales;
    fp8_tensor with typical, saturating and underflowing scales): quant_out bytes and float32
    scales exactly equal to fp8_group_ref / fp8_tensor_ref(kernel's norm_out), padding zero.

Seeds come from conftest (fresh per run; --seed N reproduces); every failure names the case.
Set MOE_AR_RESULTS=path to append a JSON line per test summary.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from gpu_worlds import FORCED_ONESHOT_CAP, recording
from moe_ar_tools import reference as ref
from generator import policy
from generator import spec as gspec

pytestmark = pytest.mark.gpu

HIDDENS = (2048, 2880, 4096, 5120, 7168, 8192)
ODD_COLUMN_HIDDEN = 2064  # H/16 = 129 scale columns: exercises the column padding of the scale layout
MAX_TOKENS = 512
# The world sizes with an exchange (emulated worlds); world size 1 is tests/test_gpu_world_one.py's.
EXCHANGE_WORLD_SIZES = tuple(w for w in gspec.WORLD_SIZES if w >= 2)
SPECS = sorted((s for s in gspec.all_cells() if policy.is_supported(s) and s.world_size >= 2),
               key=lambda s: (s.world_size, s.dtype, s.profile, s.family))
PROFILE_QUANT = dict(gspec.PROFILE_QUANT)  # output profile -> the call's quant= argument
QUANTS = tuple(PROFILE_QUANT.values())
DEVICE = "cuda"  # where single-GPU worlds and their inputs live
# Knobs for a quick run (defaults are the full test): cases per forced program, eager auto calls.
CASES_PER_PROGRAM = int(os.environ.get("MOE_AR_CASES_PER_PROGRAM", "6"))
AUTO_CALLS = int(os.environ.get("MOE_AR_AUTO_CALLS", "1000"))


def _dispatch():
    import dispatch
    return dispatch


def _devices(kind: str, ws: int):
    if kind == "one_gpu":
        return None
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return [r % 2 for r in range(ws)]


def _sync(world):
    for d in sorted(set(world.devices)):
        torch.cuda.synchronize(d)


def fp8_options(i):
    """The fp8_group128 options of case i: both scale layouts, with and without power-of-two scales."""
    return dict(fp8_layout=("row", "column")[i % 2], fp8_pow2=(i // 2) % 2 == 1)


def prepare_call(case, *, quant, programs=None, gs_factor=1.0, pdl=False, extra_scale_bytes=16,
                 nvfp4_device="cpu", label="", ref_=None, fp8_layout="row", fp8_pow2=False):
    """Reference, poisoned preallocated outputs and every rank's kwargs for one call (no launch).
    The returned dict keeps every tensor the kernels use referenced until it is checked.
    gs_factor scales the typical NVFP4 global scale (448 * 6 / amax), or divides the typical FP8
    per-tensor scale (amax / 448): > 1 saturates, tiny values underflow."""
    W = len(case)
    if not isinstance(programs, (list, tuple)):
        programs = [programs] * W
    r0 = ref_ if ref_ is not None else ref.reference_for(case)
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=extra_scale_bytes, fp8_scale_layout=fp8_layout)
    gs_val = None
    if quant == "nvfp4":
        gs_val = ref.f32(ref.typical_global_scale(r0["norm_out"]) * gs_factor)
    if quant == "fp8_tensor":
        gs_val = ref.f32(max(float(r0["norm_out"].abs().max()), 1e-3) / ref.E4M3_MAX / gs_factor)
    kwargs = []
    for r, kw in enumerate(case):
        d = dict(kw)
        d.update(provided[r])
        d.update(quant=quant, program=programs[r], launch_with_pdl=pdl)
        dev = kw["residual_in"].device
        if quant == "nvfp4":
            d["global_scale"] = torch.tensor([gs_val], dtype=torch.float32, device=dev)
        if quant == "fp8_tensor":
            d["fp8_scale"] = torch.tensor([gs_val], dtype=torch.float32, device=dev)
        if quant == "fp8_group128":
            d.update(fp8_scale_layout=fp8_layout, fp8_pow2_scales=fp8_pow2)
        kwargs.append(d)
    fp8_label = f" fp8 {fp8_layout} pow2={fp8_pow2}" if quant == "fp8_group128" else ""
    return dict(case=case, outs=None, provided=provided, quant=quant, gs=gs_val, ref=r0, kwargs=kwargs,
                fp8=dict(fp8_scale_layout=fp8_layout, fp8_pow2_scales=fp8_pow2),
                nvfp4_device=nvfp4_device if nvfp4_device != "same" else r0["norm_out"].device,
                label=f"{label} programs={programs} pdl={pdl}{fp8_label}")


def launch_world(world, case, **kw):
    """One call on every rank through world.run (joined back to the current stream); no sync."""
    call = prepare_call(case, **kw)
    call["outs"] = world.run(call["kwargs"])
    return call


def launch_direct(world, calls, rnd, streams):
    """Several calls launched rank by rank on the ranks' own streams, in a random interleaving
    that keeps each rank's call order, with no join between calls: a rank may start call n+1
    while its peers are still in call n, as separate processes do."""
    dispatch = _dispatch()
    W = len(world.workspaces)
    for c in calls:
        c["outs"] = [None] * W
    for d, s in zip(world.devices, streams):
        s.wait_stream(torch.cuda.current_stream(d))
    todo = [r for r in range(W) for _ in calls]
    rnd.shuffle(todo)
    nxt = [0] * W
    for r in todo:
        c = calls[nxt[r]]
        nxt[r] += 1
        with torch.cuda.stream(streams[r]):
            c["outs"][r] = dispatch.moe_finalize_allreduce(world.workspaces[r], **c["kwargs"][r])
    for d, s in zip(world.devices, streams):
        torch.cuda.current_stream(d).wait_stream(s)
    return calls


def finish_world(world, calls):
    """Synchronize, check for timeouts, then check every call in full."""
    _sync(world)
    world.check()
    return [ref.check_outputs(c["case"], c["outs"], c["provided"], quant=c["quant"], global_scale=c["gs"],
                              ref=c["ref"], nvfp4_device=c["nvfp4_device"], label=c["label"], **c["fp8"])
            for c in calls]


def run_world(world, case, **kw):
    """One call on every rank, synchronized and checked in full."""
    return finish_world(world, [launch_world(world, case, **kw)])[0]


def _token_plan(W, max_tokens, n, rnd):
    """T = 1, T < W, T = max_tokens, T % W != 0 past 128 rows, then random; all different kinds."""
    small = rnd.randint(2, W - 1) if W > 2 else 3
    odd = rnd.randint(129, max_tokens - 1)
    if odd % W == 0:
        odd += 1
    plan = [1, small, max_tokens, odd, rnd.randint(2, 64), rnd.randint(65, max_tokens)]
    while len(plan) < n:
        plan.append(rnd.randint(1, max_tokens))
    return plan[:n]


GS_FACTORS = (1.0, "random", 3.0, 3e-6)  # typical; random; saturating at 448; zero/subnormal E4M3 scales


def _case_kwargs(i, rnd):
    return dict(scale_kind=(None, "fp32", "dtype")[i % 3], shared=i % 2 == 0, weight_bias=(i // 2) % 2,
                rsf=1.0 if i % 3 == 1 else ref.f32(rnd.uniform(0.3, 2.5)),
                padded_rows=rnd.choice([0, 0, rnd.randint(1, 50)]), drop_frac=rnd.choice([0.0, 0.1, 0.3]))


def _gs_factor(i, rnd):
    f = GS_FACTORS[i % len(GS_FACTORS)]
    return rnd.uniform(0.05, 0.9) if f == "random" else f


# ---- the reference itself on the GPU ---------------------------------------------------------------

def test_nvfp4_ref_on_gpu_equals_cpu(seed_for):
    """Most per-call checks run nvfp4_ref on the GPU (runs first): it must agree with the CPU byte for byte."""
    seed = seed_for("x")
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(300, 7168, generator=g) * torch.rand(300, 1, generator=g) * 4).to(dtype)
        for gs in (ref.typical_global_scale(x), 1.0, 3e-6 * ref.typical_global_scale(x), 1e4):
            qc, sc = ref.nvfp4_ref(x, gs)
            qg, sg = ref.nvfp4_ref(x.cuda(), gs)
            assert torch.equal(qc, qg.cpu()) and torch.equal(sc, sg.cpu()), (seed, dtype, gs)
    # and the float64 reference on the GPU equals the CPU one
    case = ref.make_case(4, 37, 2048, 6, torch.bfloat16, seed=seed, shared=True, rsf=1.5)
    rc = ref.reference_for(case)
    rg = ref.reference_for(ref.Case([{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
                                     for kw in case], case.meta))
    for k in ("residual_out", "norm_out", "residual_lo", "residual_hi"):
        assert torch.equal(rc[k], rg[k].cpu()), (seed, k)


# ---- the body's NVFP4 encoders, for every float --------------------------------------------------

def _probe_module(probe_source: str, name: str):
    """The kernel body (generated/kernels/, its headers inlined) followed by probe kernels that call its
    device functions, compiled with the programs' options for this GPU and loaded."""
    import cupy
    from cupy.cuda import function
    from dispatch import registry
    from moe_ar_common import manifest_reader
    ps = registry.program_set()
    body = manifest_reader.body_source(ps.manifest, ps.dir)
    cc = cupy.cuda.Device().compute_capability
    target = registry.TARGET_FOR_CAPABILITY[(int(cc[:-1]), int(cc[-1]))]
    cubin, _ = registry.compile_cubin(body + probe_source, name, target)
    module = function.Module()
    module.load(cubin)
    return module


NVFP4_PROBE = r"""
// codes[i]: the nibble of x = bits(first + i) from e2m1_code, or 0xEE where e2m1x8 differs from it: x at
// each of the eight places of a vector whose other places hold fixed values (both signs, ties, a zero,
// saturation), every nibble of the word against e2m1_code's; bytes[i]: nvfp4_scale_byte(x) xor the
// byte from __fdiv_rn(x, 6) (the two codings of quantize_vector_nvfp4).
extern "C" __global__ void nvfp4_probe(unsigned char* codes, unsigned char* bytes, unsigned long long first,
                                       unsigned long long n) {
  const float others[8] = {-0.0f, 1.25f, -5.0f, 0.75f, 7.0f, -0.25f, 2.5f, -3.5f};
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float x = __uint_as_float((unsigned)(first + i));
    const unsigned nibble = moe_ar::e2m1_code(x);
    bool same = nibble < 16;
    for (int k = 0; k < 8; ++k) {
      float q[8];
      unsigned want = 0;
      for (int j = 0; j < 8; ++j) {
        q[j] = j == k ? x : others[j];
        want |= moe_ar::e2m1_code(q[j]) << (4 * j);
      }
      same = same && moe_ar::e2m1x8(q) == want;
    }
    codes[i] = same ? (unsigned char)nibble : 0xEE;
    bytes[i] = moe_ar::nvfp4_scale_byte(x) ^ __nv_cvt_float_to_fp8(__fdiv_rn(x, 6.0f), __NV_SATFINITE, __NV_E4M3);
  }
}
"""


def test_nvfp4_encoders_equal_the_rule_for_every_float():
    """For all 2^32 float32 bit patterns (both signs, zeros, subnormals, ties, saturation, infinities,
    NaNs): the kernels' E2M1 encoders (e2m1_code, one value with compares; e2m1x8, eight values by
    multiply-adds, x at each of the eight places) give the reference's nibble (moe_ar_tools/reference/quant.py: count
    the midpoints, ties to even), and the scale byte from multiply-adds equals the one from a correctly
    rounded division by 6."""
    import cupy
    probe = _probe_module(NVFP4_PROBE, "nvfp4_probe").get_function("nvfp4_probe")
    chunk = 1 << 28
    codes = cupy.empty(chunk, dtype=cupy.uint8)
    diffs = cupy.empty(chunk, dtype=cupy.uint8)
    for first in range(0, 1 << 32, chunk):
        codes.fill(0xFF)  # poison: no code is 0xFF
        diffs.fill(0xFF)
        probe((1024,), (256,), (codes, diffs, cupy.uint64(first), cupy.uint64(chunk)))
        got, diff = torch.from_dlpack(codes), torch.from_dlpack(diffs)
        bits = torch.arange(first, first + chunk, dtype=torch.int64, device=DEVICE)
        x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
        want = ref.e2m1_nibbles(x)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, [(hex(first + int(i)), float(x[i]), int(got[i]), int(want[i])) for i in bad[:8, 0]]
        bad = diff.nonzero()
        assert bad.numel() == 0, [(hex(first + int(i)), float(x[i]), int(diff[i])) for i in bad[:8, 0]]
        del bits, x, want, got, diff


FP8_PROBE = r"""
// bad[0]: bytes of fp8x8 (the kernels' FP8 path) that differ from e4m3(__fdiv_rn(x, s)) (the rule: the
// conversion saturates, as the rule's clamp does); bad[1]: corrected quotients that differ from
// __fdiv_rn where 2^-11 <= |x / s| < 2^100 (below, the remainder may fall under the normal range and the
// quotient differ in its last bits: the byte is a zero either way); bad[2]: group scales that differ
// from the division. first[]: the first difference found, as (kind, s bits, x bits, got, want).
__device__ void fp8_record(unsigned long long* bad, unsigned* first, int kind, float s, unsigned x, unsigned got,
                           unsigned want) {
  atomicAdd(bad + kind, 1ull);
  if (atomicCAS(first, 0u, 1u) == 0u) {
    first[1] = kind; first[2] = __float_as_uint(s); first[3] = x; first[4] = got; first[5] = want;
  }
}
template <typename D>
__device__ float fp8_value(unsigned bits) {  // dtype bit pattern -> float
  uint4 v = make_uint4(bits, 0, 0, 0);
  float x[8];
  moe_ar::Vec<D>::to_float(v, x);
  return x[0];
}
// Eight consecutive dtype bit patterns from `bits`, as one vector, against the scale s.
template <typename D>
__device__ void fp8_check8(unsigned bits, float s, float amax, bool pow2, unsigned long long* bad, unsigned* first) {
  const uint4 v = make_uint4(bits | (bits + 1) << 16, (bits + 2) | (bits + 3) << 16,
                             (bits + 4) | (bits + 5) << 16, (bits + 6) | (bits + 7) << 16);
  const uint2 got = moe_ar::fp8x8<D>(v, s, amax, pow2);
  const float y = __frcp_rn(s);
  for (int j = 0; j < 8; ++j) {
    const float x = fp8_value<D>(bits + j), want = __fdiv_rn(x, s);
    const unsigned g = ((j < 4 ? got.x : got.y) >> (8 * (j % 4))) & 0xffu;
    const unsigned w = __nv_cvt_float_to_fp8(want, __NV_SATFINITE, __NV_E4M3);
    if (g != w) fp8_record(bad, first, 0, s, bits + j, g, w);
    const float q = moe_ar::corrected_quotient(x, s, y, __fmul_rn(x, y));
    // where the template's scaling argument needs the quotient itself: |x / s| >= 2^-11, no overflow
    const bool covered = fabsf(want) >= 0x1p-11f && fabsf(want) < 0x1p100f && s >= 0x1p-64f && s <= 0x1p64f;
    if (covered && __float_as_uint(q) != __float_as_uint(want))
      fp8_record(bad, first, 1, s, bits + j, __float_as_uint(q), __float_as_uint(want));
  }
}
// Per-tensor: every dtype value x (8 at a time, amax as the kernel takes it) against n scales:
// s_bits[i] if given, else the float with bits 0x3f800000 + i (every s in [1, 2)).
template <typename D>
__device__ void fp8_tensor_probe(const unsigned* s_bits, unsigned long long n, unsigned long long* bad,
                                 unsigned* first) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float s = __uint_as_float(s_bits ? s_bits[i] : 0x3f800000u + (unsigned)i);
    for (unsigned bits = 0; bits < 0x10000u; bits += 8) {
      const uint4 v = make_uint4(bits | (bits + 1) << 16, (bits + 2) | (bits + 3) << 16,
                                 (bits + 4) | (bits + 5) << 16, (bits + 6) | (bits + 7) << 16);
      fp8_check8<D>(bits, s, moe_ar::amax_of<D>(v), false, bad, first);
    }
  }
}
// FP8-group: every dtype amax that is not NaN (one thread each), its scale (and the power-of-two one)
// against every dtype x with |x| <= amax or NaN (8 at a time; where a lane of the 8 is past amax, one
// at a time, the other lanes 0).
template <typename D>
__device__ void fp8_group_probe(unsigned long long* bad, unsigned* first) {
  const unsigned a = blockIdx.x * blockDim.x + threadIdx.x;
  if (a >= 0x8000u) return;
  const float amax = fp8_value<D>(a);
  if (isnan(amax)) return;
  const float s = moe_ar::fp8_group_scale(amax), want = __fdiv_rn(fmaxf(amax, moe_ar::kFp8GroupEps), moe_ar::kE4m3Max);
  if (__float_as_uint(s) != __float_as_uint(want)) fp8_record(bad, first, 2, amax, a, __float_as_uint(s), __float_as_uint(want));
  const float s2 = moe_ar::pow2_ceil(s);
  for (unsigned bits = 0; bits < 0x10000u; bits += 8) {
    unsigned b[8];
    for (int j = 0; j < 8; ++j) {
      const float x = fp8_value<D>(bits + j);
      b[j] = fabsf(x) > amax ? 0u : bits + j;  // beyond amax: not in this group
    }
    bool all = true;
    for (int j = 0; j < 8; ++j) all = all && b[j] == bits + j;
    if (all) {
      fp8_check8<D>(bits, s, amax, false, bad, first);
      if (isfinite(s2)) fp8_check8<D>(bits, s2, amax, true, bad, first);
    } else {
      for (int j = 0; j < 8; ++j)
        if (b[j] == bits + j) {  // one at a time, the other lanes 0
          const uint4 v = make_uint4(b[j], 0, 0, 0);
          const unsigned g = moe_ar::fp8x8<D>(v, s, amax, false).x & 0xffu;
          const unsigned w = __nv_cvt_float_to_fp8(__fdiv_rn(fp8_value<D>(b[j]), s), __NV_SATFINITE, __NV_E4M3);
          if (g != w) fp8_record(bad, first, 0, s, b[j], g, w);
        }
    }
  }
}
extern "C" __global__ void fp8_tensor_probe_bf16(const unsigned* s, unsigned long long n, unsigned long long* bad, unsigned* first) {
  fp8_tensor_probe<__nv_bfloat16>(s, n, bad, first);
}
extern "C" __global__ void fp8_tensor_probe_fp16(const unsigned* s, unsigned long long n, unsigned long long* bad, unsigned* first) {
  fp8_tensor_probe<__half>(s, n, bad, first);
}
extern "C" __global__ void fp8_group_probe_bf16(unsigned long long* bad, unsigned* first) {
  fp8_group_probe<__nv_bfloat16>(bad, first);
}
extern "C" __global__ void fp8_group_probe_fp16(unsigned long long* bad, unsigned* first) {
  fp8_group_probe<__half>(bad, first);
}
"""


def test_fp8_division_equals_the_rule():
    """The FP8 profiles divide by multiply-adds (corrected_quotient) instead of __fdiv_rn. Exhaustive
    where the template's comment says the result rests on it, both dtypes:
    - FP8-group: every (x, amax) pair of dtype values with |x| <= amax, NaN x included: the scale
      equals the division, and the bytes (also with the power-of-two scale) equal e4m3(x / s);
    - per-tensor: every float s in [1, 2) against every dtype value x: the bytes equal e4m3(x / s),
      and the quotient equals the correctly rounded one wherever 2^-11 <= |x / s| < 2^100 (with the
      scaling argument in the template's comment, that covers every s in [2^-64, 2^64]);
    - per-tensor, 2^16 other scales (the range's ends and their neighbours, zeros, subnormals,
      negatives, infinities, NaNs, random bit patterns) against every x: the bytes."""
    import cupy
    import numpy as np
    module = _probe_module(FP8_PROBE, "fp8_probe")
    rng = np.random.default_rng(20261130)
    ends = [2.0 ** -64, 2.0 ** 64]
    special = np.array([0x00000000, 0x80000000, 0x00000001, 0x007fffff, 0x00800000, 0x7f7fffff, 0x7f800000,
                        0xff800000, 0x7fc00000, 0xffc00000, 0x3f800000, 0xbf800000], dtype=np.uint32)
    near = np.concatenate([np.arange(-64, 65, dtype=np.int64) + int(np.float32(e).view(np.uint32)) for e in ends])
    others = np.concatenate([special, near.astype(np.uint32),
                             rng.integers(0, 1 << 32, (1 << 16) - special.size - near.size, dtype=np.uint32)])
    others_dev = cupy.asarray(others)
    for dname in ("bf16", "fp16"):
        for kernel, args, blocks in (
                (f"fp8_group_probe_{dname}", (), 128),
                (f"fp8_tensor_probe_{dname}", (cupy.uint64(0), cupy.uint64(1 << 23)), 4096),
                (f"fp8_tensor_probe_{dname}", (others_dev, cupy.uint64(others.size)), 256)):
            bad = cupy.zeros(3, dtype=cupy.uint64)
            first = cupy.zeros(6, dtype=cupy.uint32)
            module.get_function(kernel)((blocks,), (256,), (*args, bad, first) if args else (bad, first))
            counts, ex = bad.get().tolist(), first.get().tolist()
            kind = ("byte", "quotient", "group scale")[ex[1]] if ex[0] else None
            assert counts == [0, 0, 0], (kernel, counts, kind, [hex(v) for v in ex[2:]])

# ---- every program, forced ---------------------------------------------------------------------

PROGRAM_PARAMS = [pytest.param(kind, s.name, id=f"{s.name}-{kind}")
                  for kind in ("one_gpu", "two_gpus") for s in SPECS]


@pytest.mark.parametrize("devices_kind,program", PROGRAM_PARAMS)
def test_program_matches_reference(devices_kind, program, worlds, seed_for, base_seed, record_result):
    dispatch = _dispatch()
    s = gspec.parse(program)
    assert program in dispatch.programs(), f"{program} is a supported cell but dispatch does not list it"
    devices = _devices(devices_kind, s.world_size)
    dtype = ref.NAME_TO_DTYPE[s.dtype]
    quant = PROFILE_QUANT[s.profile]
    # one hidden per (world size, dtype) per run, so consecutive programs share a world (a multiple
    # of 128 for fp8_group128, whose groups need one)
    group = s.profile == "fp8_group128"
    hidden = random.Random(f"{base_seed}:{s.world_size}:{s.dtype}:{devices_kind}:{group}").choice(
        [h for h in HIDDENS if not group or h % 128 == 0])
    world = worlds.get(s.world_size, MAX_TOKENS, hidden, dtype, devices)
    rnd = random.Random(seed_for("plan"))
    n = CASES_PER_PROGRAM if devices_kind == "one_gpu" else max(1, CASES_PER_PROGRAM // 2)
    with recording(record_result, cases=0, program=program, devices=devices_kind, hidden=hidden) as info:
        for i, T in enumerate(_token_plan(s.world_size, MAX_TOKENS, n, rnd)):
            K = 8 if i == 0 else rnd.randint(1, 8)
            case = ref.make_case(s.world_size, T, hidden, K, dtype, seed=seed_for(f"case{i}"),
                                 device=devices or DEVICE, **_case_kwargs(i, rnd))
            run_world(world, case, quant=quant, programs=program, gs_factor=_gs_factor(i, rnd),
                      pdl=bool(i % 2), nvfp4_device="cpu" if i == 0 else "same", label=program, **fp8_options(i))
            info["cases"] += 1


# ---- hidden sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("ws", EXCHANGE_WORLD_SIZES)
@pytest.mark.parametrize("hidden", HIDDENS + (ODD_COLUMN_HIDDEN,))
def test_hidden_sweep_every_program(hidden, ws, seed_for, record_result):
    """Every program of one (world size, random dtype) at this H, one random case each."""
    dispatch = _dispatch()
    rnd = random.Random(seed_for("plan"))
    dname = rnd.choice(gspec.DTYPES)
    dtype = ref.NAME_TO_DTYPE[dname]
    names = [s.name for s in SPECS if s.world_size == ws and s.dtype == dname]
    max_tokens = 384
    world = dispatch.EmulatedWorld(ws, max_tokens, hidden, dtype, timeout_s=10.0,
                                   oneshot_max_tokens=min(max_tokens, FORCED_ONESHOT_CAP))
    try:
        with recording(record_result, cases=0, program=f"all ws{ws} {dname}", hidden=hidden) as info:
            for j, name in enumerate(names):
                s = gspec.parse(name)
                T = rnd.choice([rnd.randint(1, 16), rnd.randint(129, max_tokens), max_tokens, rnd.randint(17, 128)])
                case = ref.make_case(ws, T, hidden, rnd.randint(1, 8), dtype, seed=seed_for(f"case{j}"),
                                     device=DEVICE, **_case_kwargs(j + rnd.randint(0, 5), rnd))
                if s.profile == "fp8_group128" and hidden % 128:  # refused by name, and nothing launched
                    call = prepare_call(case, quant="fp8_group128", programs=name)
                    with pytest.raises(ValueError, match=r"^quant: 'fp8_group128' needs hidden"):
                        world.run(call["kwargs"])
                    continue
                run_world(world, case, quant=PROFILE_QUANT[s.profile], programs=name,
                          gs_factor=_gs_factor(j, rnd), pdl=rnd.random() < 0.5,
                          nvfp4_device="cpu" if j == 0 else "same", label=f"{name} H={hidden}",
                          **fp8_options(rnd.randint(0, 3)))
                info["cases"] += 1
    finally:
        world.close()


# ---- mixed programs of one protocol class --------------------------------------------------------

@pytest.mark.parametrize("devices_kind", ["one_gpu", "two_gpus"])
@pytest.mark.parametrize("profile", gspec.OUTPUT_PROFILES)
@pytest.mark.parametrize("dname", gspec.DTYPES)
@pytest.mark.parametrize("ws", [4, 8, 16])
def test_mixed_programs_within_protocol_class(ws, dname, profile, devices_kind, seed_for, record_result):
    """Rank 0 runs a shared-prefetch variant, the others the base two-shot (same class); also with
    only rank 0 holding a shared-expert operand, and random mixes of the whole class."""
    dispatch = _dispatch()
    devices = _devices(devices_kind, ws)
    dtype = ref.NAME_TO_DTYPE[dname]
    quant = PROFILE_QUANT[profile]
    rnd = random.Random(seed_for("plan"))
    hidden = rnd.choice([h for h in HIDDENS if profile != "fp8_group128" or h % 128 == 0])
    cls = [s for s in SPECS if s.world_size == ws and s.dtype == dname and s.profile == profile
           and gspec.PROTOCOL[s.family] == "lamport2"]
    infos = {s.name: dispatch.program_info(s.name) for s in cls}
    assert len({i["protocol_class"] for i in infos.values()}) == 1, infos
    base = next(s.name for s in cls if s.family == "twoshot")
    shared_variants = [s.name for s in cls if s.family.endswith("_shared")]
    assert shared_variants, f"no shared variant at ws{ws} {dname} {profile}"
    max_tokens = 384
    world = dispatch.EmulatedWorld(ws, max_tokens, hidden, dtype, devices=devices, timeout_s=10.0,
                                                   oneshot_max_tokens=min(max_tokens, FORCED_ONESHOT_CAP))
    try:
        with recording(record_result, cases=0, program=f"mixed lamport2 ws{ws} {dname} {profile}", hidden=hidden,
                       devices=devices_kind) as info:
            plans = []
            for v in shared_variants:
                plans.append(("all_shared", [v] + [base] * (ws - 1)))
                plans.append(("rank0_shared", [v] + [base] * (ws - 1)))
            for _ in range(3):
                plans.append(("random", [rnd.choice(list(infos)) for _ in range(ws)]))
            for j, (mode, progs) in enumerate(plans):
                T = rnd.choice([rnd.randint(1, ws + 3), rnd.randint(ws, 128), rnd.randint(129, max_tokens)])
                case = ref.make_case(ws, T, hidden, rnd.randint(1, 8), dtype, seed=seed_for(f"case{j}"),
                                     device=devices or DEVICE, shared=True,
                                     scale_kind=rnd.choice([None, "fp32", "dtype"]),
                                     rsf=rnd.choice([1.0, ref.f32(rnd.uniform(0.5, 2))]), weight_bias=rnd.randint(0, 1))
                if mode == "rank0_shared":
                    for kw in case[1:]:
                        kw["shared_expert_output"] = None
                elif mode == "random":
                    for kw in case:
                        if rnd.random() < 0.5:
                            kw["shared_expert_output"] = None
                case.meta["shared"] = [kw["shared_expert_output"] is not None for kw in case]
                run_world(world, case, quant=quant, programs=progs, gs_factor=_gs_factor(j, rnd),
                          pdl=rnd.random() < 0.5, label=f"mixed {mode}", **fp8_options(j))
                info["cases"] += 1
    finally:
        world.close()


@pytest.mark.parametrize("devices_kind", ["one_gpu", "two_gpus"])
@pytest.mark.parametrize("profile", gspec.OUTPUT_PROFILES)
def test_pipelined_mixes_with_the_two_shot_class(profile, devices_kind, seed_for, record_result):
    """World size 2: the pipelined two-shot on one rank and another program of its protocol class on
    the other, and random programs of the class call after call. The pipelined program leaves its
    buffer clean (extent 0) while the others leave theirs for the next call to clear, so this
    crosses every switch between the two bookkeepings."""
    dispatch = _dispatch()
    ws = 2
    devices = _devices(devices_kind, ws)
    rnd = random.Random(seed_for("plan"))
    dname = rnd.choice(gspec.DTYPES)
    dtype = ref.NAME_TO_DTYPE[dname]
    quant = PROFILE_QUANT[profile]
    hidden = rnd.choice([h for h in HIDDENS if profile != "fp8_group128" or h % 128 == 0])
    cls = [s.name for s in SPECS if s.world_size == ws and s.dtype == dname and s.profile == profile
           and gspec.PROTOCOL[s.family] == "lamport2"]
    pipelined = next(n for n in cls if dispatch.program_info(n)["family"] == "twoshot_pipelined")
    others = [n for n in cls if n != pipelined]
    assert others, cls
    max_tokens = 384
    world = dispatch.EmulatedWorld(ws, max_tokens, hidden, dtype, devices=devices, timeout_s=10.0,
                                                   oneshot_max_tokens=min(max_tokens, FORCED_ONESHOT_CAP))
    try:
        with recording(record_result, cases=0,
                       program=f"mixed lamport2 ws2 {dname} {profile} (pipelined)", hidden=hidden,
                       devices=devices_kind) as info:
            plans = [[pipelined, o] for o in others] + [[o, pipelined] for o in others]
            plans += [[rnd.choice(cls), rnd.choice(cls)] for _ in range(8)]
            for j, progs in enumerate(plans):
                T = rnd.choice([rnd.randint(1, 5), rnd.randint(2, 128), rnd.randint(129, max_tokens)])
                case = ref.make_case(ws, T, hidden, rnd.randint(1, 8), dtype, seed=seed_for(f"case{j}"),
                                     device=devices or DEVICE, shared=rnd.random() < 0.7,
                                     scale_kind=rnd.choice([None, "fp32", "dtype"]),
                                     rsf=rnd.choice([1.0, ref.f32(rnd.uniform(0.5, 2))]), weight_bias=rnd.randint(0, 1))
                run_world(world, case, quant=quant, programs=progs, gs_factor=_gs_factor(j, rnd),
                          pdl=rnd.random() < 0.5, label=f"mixed {progs}", **fp8_options(j))
                info["cases"] += 1
    finally:
        world.close()


# ---- automatic selection: 1,000 calls crossing every regime boundary -------------------------------

def regime_boundaries(dispatch, ws_obj, max_tokens):
    """Token counts T where the selected program differs from T - 1's, for any (quant, shared).

    Also asserts the rank-local shared-expert choice never leaves the protocol class."""
    combos = [(q, sh) for q in QUANTS for sh in (False, True)]
    sel = {c: [dispatch.select_program(ws_obj, T, c[0], c[1]) for T in range(1, max_tokens + 1)] for c in combos}
    for q in QUANTS:
        for T in range(1, max_tokens + 1):
            a, b = sel[(q, False)][T - 1], sel[(q, True)][T - 1]
            ca, cb = dispatch.program_info(a)["protocol_class"], dispatch.program_info(b)["protocol_class"]
            assert ca == cb, f"T={T} quant={q}: {a} ({ca}) without shared, {b} ({cb}) with: ranks would deadlock"
    bounds = sorted({T for c in combos for T in range(2, max_tokens + 1) if sel[c][T - 1] != sel[c][T - 2]})
    return bounds, sel


def crossing_sequence(bounds, max_tokens, n, rnd, W):
    specials = sorted({1, max(1, W - 1), W, W + 1, max_tokens})
    seq, prev = [], 1
    while len(seq) < n:
        x = rnd.random()
        if bounds and x < 0.7:
            b = rnd.choice(bounds)
            T = b - 1 - rnd.randint(0, 2) if prev >= b else b + rnd.randint(0, 2)
        elif x < 0.8:
            T = rnd.choice(specials)
        else:
            T = rnd.randint(1, max_tokens)
        T = min(max(T, 1), max_tokens)
        seq.append(T)
        prev = T
    return seq


def _crossings(seq, b):
    up = sum(1 for a, c in zip(seq, seq[1:]) if a < b <= c)
    down = sum(1 for a, c in zip(seq, seq[1:]) if c < b <= a)
    return up, down


AUTO_MAX_TOKENS = 1536
AUTO_HIDDEN = 2048
# Replays of each captured graph: 6 to 8 graphs (one per regime and PDL setting, plus the
# back-to-back ones) of 8 to 12 calls in all: at least 1,024 graph-replayed calls per world size.
REPLAYS_PER_GRAPH = int(os.environ.get("MOE_AR_GRAPH_REPLAYS", "128"))


def _random_call_case(W, T, hidden, dtype, seed, rnd, device=None):
    shared_mode = rnd.choice(["none", "all", "rank0"])
    case = ref.make_case(W, T, hidden, rnd.randint(1, 8), dtype, seed=seed, device=device or DEVICE,
                         shared=shared_mode != "none", scale_kind=rnd.choice([None, "fp32", "dtype"]),
                         rsf=rnd.choice([1.0, ref.f32(rnd.uniform(0.5, 2))]), weight_bias=rnd.randint(0, 1),
                         padded_rows=rnd.choice([0, 7]), drop_frac=rnd.choice([0.0, 0.2]))
    if shared_mode == "rank0":
        for kw in case[1:]:
            kw["shared_expert_output"] = None
    case.meta["shared"] = shared_mode
    return case


@pytest.mark.parametrize("ws", EXCHANGE_WORLD_SIZES)
def test_auto_selection_1000_calls_crossing_regimes(ws, seed_for, record_result):
    dispatch = _dispatch()
    rnd = random.Random(seed_for("plan"))
    dname = rnd.choice(gspec.DTYPES)
    dtype = ref.NAME_TO_DTYPE[dname]
    # World size 2 runs on two GPUs where there are two, one rank each, as real ranks run.
    devices = [0, 1] if ws == 2 and torch.cuda.device_count() >= 2 else None
    world = dispatch.EmulatedWorld(ws, AUTO_MAX_TOKENS, AUTO_HIDDEN, dtype, timeout_s=10.0, devices=devices)
    # Bursts launch each rank's calls separately, several in flight at once. With PDL, and two
    # ranks sharing one GPU, such bursts timed out now and then (6 of ~140 bursts of 8, world size 2,
    # 2026-11-30), never with PDL off, never with the same bursts over two GPUs (~260 bursts), and
    # never through world.run or graph replays: an emulation artifact still being investigated
    # (bench_results/gpu_tests/README.md; none in 2,337 probe bursts at 5f8bdbd, not yet
    # attributed). Bursts on a shared GPU therefore run without PDL; PDL is still tested there
    # through world.run calls and graphs, and in bursts across GPUs.
    shared_gpu = len(set(world.devices)) < ws
    case_device = [f"cuda:{d}" for d in world.devices] if devices else None
    try:
        bounds, _ = regime_boundaries(dispatch, world.workspaces[0], AUTO_MAX_TOKENS)
        assert bounds, "automatic selection never changes program over 1..max_tokens"
        seq = crossing_sequence(bounds, AUTO_MAX_TOKENS, AUTO_CALLS, rnd, ws)
        for b in bounds:
            up, down = _crossings(seq, b)
            assert up and down, (b, up, down)
        # Bursts launch rank by rank, so a program's first use would happen while other ranks'
        # kernels spin: load every program first, as an engine would at start-up.
        for d in sorted(set(world.devices)):
            dispatch.warmup([s.name for s in SPECS if s.world_size == ws and s.dtype == dname], device_index=d)
        with recording(record_result, cases=0,
                       program=f"auto ws{ws} {dname}", boundaries=bounds, devices=world.devices) as info:
            streams = [torch.cuda.Stream(device=d) for d in world.devices]
            i = 0
            while i < len(seq):
                # mostly one call at a time through world.run; sometimes a burst launched rank by
                # rank with no join between calls, so ranks run different calls at once
                burst = rnd.choice([1, 1, 1, 4, 8])
                calls = []
                for T in seq[i:i + burst]:
                    case = _random_call_case(ws, T, AUTO_HIDDEN, dtype, seed_for(f"call{i}"), rnd, device=case_device)
                    calls.append(prepare_call(
                        case, quant=rnd.choice(QUANTS), programs=None, gs_factor=_gs_factor(i, rnd),
                        pdl=rnd.random() < 0.5 and (burst == 1 or not shared_gpu),
                        nvfp4_device="cpu" if i % 50 == 0 else "same",
                        label=f"auto call {i} of {len(seq)} (burst of {burst}, previous T={seq[i - 1] if i else None})",
                        **fp8_options(rnd.randint(0, 3))))
                    i += 1
                if burst == 1:
                    calls[0]["outs"] = world.run(calls[0]["kwargs"])
                else:
                    launch_direct(world, calls, rnd, streams)
                finish_world(world, calls)
                info["cases"] += len(calls)
    finally:
        world.close()


# ---- CUDA graphs -------------------------------------------------------------------------------------

def _static_call(world, ws, T, dtype, seed, rnd, pdl):
    """Static inputs, poisoned outputs and kwargs for one captured world.run call."""
    quant = rnd.choice([None, "nvfp4", "fp8_group128"])
    fp8 = dict(fp8_scale_layout=rnd.choice(["row", "column"]), fp8_pow2_scales=rnd.random() < 0.5)
    case = _random_call_case(ws, T, AUTO_HIDDEN, dtype, seed, rnd)
    provided = ref.alloc_outputs(case, quant, fp8_scale_layout=fp8["fp8_scale_layout"])
    gs = [torch.ones(1, dtype=torch.float32, device=DEVICE) for _ in range(ws)]
    kwargs = []
    for r, kw in enumerate(case):
        d = dict(kw)
        d.update(provided[r], quant=quant, launch_with_pdl=pdl, program=None)
        if quant == "nvfp4":
            d["global_scale"] = gs[r]
        if quant == "fp8_group128":
            d.update(fp8)
        kwargs.append(d)
    return dict(case=case, provided=provided, gs=gs, kwargs=kwargs, quant=quant, T=T, fp8=fp8)


def _refresh(call, ws, dtype, seed, gs_factor):
    """Copy fresh random values into the static inputs; returns (case with those values, gs)."""
    c0 = call["case"]
    m = c0.meta
    fresh = ref.make_case(ws, m["tokens"], AUTO_HIDDEN, m["top_k"], dtype, seed=seed, device=DEVICE,
                          shared=m["shared"] != "none", scale_kind=m["scale_kind"], rsf=m["rsf"],
                          weight_bias=m["weight_bias"], padded_rows=m["padded_rows"], drop_frac=m["drop_frac"])
    for dst, src in zip(c0, fresh):
        if dst["shared_expert_output"] is None:
            src["shared_expert_output"] = None
        for k, v in dst.items():
            if isinstance(v, torch.Tensor):
                v.copy_(src[k])
    fresh.meta["shared"] = m["shared"]
    gs_val = None
    if call["quant"] == "nvfp4":
        gs_val = ref.f32(ref.typical_global_scale(ref.reference_for(fresh)["norm_out"]) * gs_factor)
        for t in call["gs"]:
            t.fill_(gs_val)
    for p in call["provided"]:
        ref.repoison(p)
    return fresh, gs_val


@pytest.mark.parametrize("ws", EXCHANGE_WORLD_SIZES)
def test_cuda_graph_replay_with_changing_inputs(ws, seed_for, record_result):
    """One graph per (T, PDL) with T in every regime, plus graphs of three back-to-back calls of
    different T; replays interleaved across graphs and with eager calls of other T, fresh input
    values (and global scale) copied into the static tensors before every replay."""
    dispatch = _dispatch()
    rnd = random.Random(seed_for("plan"))
    dname = rnd.choice(gspec.DTYPES)
    dtype = ref.NAME_TO_DTYPE[dname]
    world = dispatch.EmulatedWorld(ws, AUTO_MAX_TOKENS, AUTO_HIDDEN, dtype, timeout_s=10.0)
    try:
        bounds, _ = regime_boundaries(dispatch, world.workspaces[0], AUTO_MAX_TOKENS)
        edges = [1] + bounds + [AUTO_MAX_TOKENS + 1]
        token_counts = [rnd.randint(lo, hi - 1) for lo, hi in zip(edges, edges[1:])]
        shapes = [[T] for T in token_counts] + [rnd.sample(token_counts, len(token_counts))]
        streams = [torch.cuda.Stream(device=d) for d in world.devices]
        graphs = []
        for gi, Ts in enumerate(shapes):
            for pdl in (False, True):
                calls = [_static_call(world, ws, T, dtype, seed_for(f"static{gi}.{j}.{pdl}"), rnd, pdl)
                         for j, T in enumerate(Ts)]
                for c in calls:  # eager warm-up: builds the launchers
                    world.run(c["kwargs"])
                _sync(world)
                world.check()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    if len(calls) == 1:
                        calls[0]["outs"] = world.run(calls[0]["kwargs"])
                    else:  # back to back, no join between calls (ranks overlap consecutive calls)
                        launch_direct(world, calls, rnd, streams)
                _sync(world)
                graphs.append(dict(graph=g, calls=calls, pdl=pdl))
        with recording(record_result, cases=0, program=f"graphs ws{ws} {dname}", token_counts=token_counts) as info:
            order = [i % len(graphs) for i in range(len(graphs) * REPLAYS_PER_GRAPH)]
            rnd.shuffle(order)
            for i, gi in enumerate(order):
                st = graphs[gi]
                fresh = [_refresh(c, ws, dtype, seed_for(f"replay{i}.{j}"), _gs_factor(i + j, rnd))
                         for j, c in enumerate(st["calls"])]
                st["graph"].replay()
                _sync(world)
                world.check()
                for j, (c, (case, gs_val)) in enumerate(zip(st["calls"], fresh)):
                    ref.check_outputs(case, c["outs"], c["provided"], quant=c["quant"], global_scale=gs_val,
                                      nvfp4_device="cpu" if i % 40 == 0 else DEVICE,
                                      label=f"replay {i}: graph of T={[x['T'] for x in st['calls']]} call {j} "
                                            f"pdl={st['pdl']}", **c["fp8"])
                    info["cases"] += 1
                if i % 4 == 3:  # an eager call of another T between replays
                    T = rnd.randint(1, AUTO_MAX_TOKENS)
                    case = _random_call_case(ws, T, AUTO_HIDDEN, dtype, seed_for(f"eager{i}"), rnd)
                    run_world(world, case, quant=rnd.choice(QUANTS), pdl=rnd.random() < 0.5,
                              nvfp4_device="same", label=f"eager between replays {i}", **fp8_options(i // 4))
                    info["cases"] += 1
    finally:
        world.close()
