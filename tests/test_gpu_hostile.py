"""Hostile calls the host cannot refuse, or may accept only where proven safe (GPU, emulated worlds).

- In place: residual_out given as residual_in itself (what engines do) on every rank. Every program
  at world size 2 (forced), and a sample of every family at world sizes 4 and 8; every element
  against the float64 reference computed from a copy of residual_in taken before the call.
- Device scales the host cannot check without a synchronization: global_scale (NVFP4) and
  fp8_scale (FP8 per tensor) of 0, -0, negative, NaN, +-inf, the smallest subnormal and a huge
  value, on every world-size-2 program of the profile (one-shot, two-shots, pipelined). The bytes
  must be the rule's arithmetic applied as written (moe_ar_tools/reference/quant.py, dispatch/API.md's table),
  with zero elements and a zero block in norm_out (gamma 0 there) for the 0 / 0 and 0 * inf cases.
  Each call runs twice with different output poisons, so an unwritten byte cannot pass for an
  expected one.
- Memory shared between ranks: an output of one rank over a tensor of another is refused by
  EmulatedWorld.run before any rank launches, and the world keeps working.

Seeds from conftest (--seed N reproduces); MOE_AR_RESULTS=path appends a JSON line per test.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from gpu_worlds import recording
from moe_ar_tools import reference as ref
from generator import policy
from generator import spec as gspec

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
MAX_TOKENS = 256
HIDDENS = (2048, 4096, 7168)  # multiples of 128: every profile
SPECS = sorted((s for s in gspec.all_cells() if policy.is_supported(s)),
               key=lambda s: (s.world_size, s.dtype, s.profile, s.family))
PROFILE_QUANT = dict(gspec.PROFILE_QUANT)


def _dispatch():
    import dispatch
    return dispatch


def _hidden(base_seed, ws, dname):
    """One hidden per (world size, dtype) per run, so consecutive tests share a world."""
    return random.Random(f"{base_seed}:{ws}:{dname}").choice(HIDDENS)


def _quant_args(quant, r0, rnd, dev, scale=None):
    """quant's keyword arguments for one rank and the value check_outputs checks against. scale:
    the device scale to pass (default: a typical one from the reference's norm_out)."""
    if quant == "nvfp4":
        v = ref.f32(ref.typical_global_scale(r0["norm_out"])) if scale is None else scale
        return dict(global_scale=torch.tensor([v], dtype=torch.float32, device=dev)), v, {}
    if quant == "fp8_tensor":
        v = ref.f32(max(float(r0["norm_out"].abs().max()), 1e-3) / ref.E4M3_MAX) if scale is None else scale
        return dict(fp8_scale=torch.tensor([v], dtype=torch.float32, device=dev)), v, {}
    if quant == "fp8_group128":
        fp8 = dict(fp8_scale_layout=rnd.choice(["row", "column"]), fp8_pow2_scales=rnd.random() < 0.5)
        return dict(fp8), None, fp8
    return {}, None, {}


# ---- in place: residual_out is residual_in -----------------------------------------------------------

def _inplace_call(world, program, T, seed, rnd, label, quant_ref_device):
    """One call of every rank with residual_out = residual_in, checked in full against the reference
    of a copy of residual_in taken before the call (the quantized bytes' rule on quant_ref_device)."""
    s = gspec.parse(program)
    W = s.world_size
    quant = PROFILE_QUANT[s.profile]
    case = ref.make_case(W, T, world.hidden, rnd.randint(1, 8), world.dtype, seed=seed, device=DEVICE,
                         scale_kind=rnd.choice([None, "fp32", "dtype"]), shared=rnd.random() < 0.7,
                         rsf=rnd.choice([1.0, ref.f32(rnd.uniform(0.5, 2.0))]), weight_bias=rnd.randint(0, 1),
                         padded_rows=rnd.choice([0, rnd.randint(1, 40)]))
    pristine = ref.Case([dict(kw, residual_in=kw["residual_in"].clone()) for kw in case], case.meta)
    r0 = ref.reference_for(pristine)
    qargs, gs, fp8 = _quant_args(quant, r0, rnd, DEVICE)
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16,
                                 fp8_scale_layout=fp8.get("fp8_scale_layout", "row"))
    kwargs = []
    for kw, p in zip(case, provided):
        p["residual_out"] = kw["residual_in"]  # in place
        kwargs.append(dict(kw, **p, **qargs, quant=quant, program=program, launch_with_pdl=rnd.random() < 0.5))
    outs = world.run(kwargs)
    torch.cuda.synchronize()
    world.check()
    for kw, o in zip(case, outs):
        assert o.residual_out.data_ptr() == kw["residual_in"].data_ptr()
    ref.check_outputs(pristine, outs, provided, quant=quant, global_scale=gs, ref=r0, nvfp4_device=quant_ref_device,
                      label=f"{label} in place (residual_out is residual_in)", **fp8)


def _inplace_params():
    params = [pytest.param(s.name, id=s.name) for s in SPECS if s.world_size == 2]
    for ws in (4, 8):  # a sample: every family once, its dtype and profile drawn from the seed below
        families = sorted({s.family for s in SPECS if s.world_size == ws})
        params += [pytest.param(f"ws{ws}:{f}", id=f"ws{ws}-{f}") for f in families]
    return params


@pytest.mark.parametrize("target", _inplace_params())
def test_residual_out_may_be_residual_in(target, worlds, seed_for, base_seed, record_result):
    rnd = random.Random(seed_for("plan"))
    if target.startswith("ws"):
        ws, family = int(target[2]), target.split(":")[1]
        program = rnd.choice([s.name for s in SPECS if s.world_size == ws and s.family == family])
    else:
        program = target
    s = gspec.parse(program)
    dtype = ref.NAME_TO_DTYPE[s.dtype]
    world = worlds.get(s.world_size, MAX_TOKENS, _hidden(base_seed, s.world_size, s.dtype), dtype)
    with recording(record_result, cases=0,
                   program=program, hidden=world.hidden, hostile="residual_out is residual_in") as info:
        for i, T in enumerate((rnd.randint(1, 16), rnd.randint(17, MAX_TOKENS))):
            _inplace_call(world, program, T, seed_for(f"case{i}"), rnd, program, ("cpu", DEVICE)[i])
            info["cases"] += 1


# ---- device scales: 0, -0, negative, NaN, +-inf, subnormal, huge --------------------------------------

SPECIAL_SCALES = {"+0": 0.0, "-0": -0.0, "negative": "negative", "nan": math.nan, "+inf": math.inf,
                  "-inf": -math.inf, "subnormal": 2.0 ** -149, "huge": 3e38}
POISONS = (0xAB, 0x54)  # two runs: a byte left unwritten equals the expected one in at most one


def _zero_some_gamma(case, hidden):
    """gamma 0 on a whole 16-element block and on two single elements (one -0), and 1e-6 on another
    block: norm_out has zeros (the rule's 0 / 0 and 0 * inf cases) and a block whose NVFP4 scale
    byte underflows to a signed zero (byte 0x80 under a negative global scale)."""
    for kw in case:
        g = kw["norm_weight"]
        g[16:32] = 0.0
        g[48:64] = 1e-6
        g[hidden // 2 + 3] = 0.0
        g[hidden - 5] = -0.0


def _special_call(world, program, T, seed, rnd, value, poison, quant_ref_device):
    s = gspec.parse(program)
    quant = PROFILE_QUANT[s.profile]
    case = ref.make_case(2, T, world.hidden, rnd.randint(1, 8), world.dtype, seed=seed, device=DEVICE,
                         scale_kind=rnd.choice([None, "fp32"]), shared=rnd.random() < 0.5, weight_bias=0)
    _zero_some_gamma(case, world.hidden)
    r0 = ref.reference_for(case)
    scale = value
    if value == "negative":
        scale = -_quant_args(quant, r0, rnd, DEVICE)[1]
    qargs, gs, _ = _quant_args(quant, r0, rnd, DEVICE, scale=ref.f32(scale))
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16, poison_byte=poison)
    for p in provided:
        p["quant_out"].view(torch.uint8).fill_(poison)
    kwargs = [dict(kw, **p, **qargs, quant=quant, program=program, launch_with_pdl=rnd.random() < 0.5)
              for kw, p in zip(case, provided)]
    outs = world.run(kwargs)
    torch.cuda.synchronize()
    world.check()
    ref.check_outputs(case, outs, provided, quant=quant, global_scale=gs, ref=r0, poison_byte=poison,
                      nvfp4_device=quant_ref_device,
                      label=f"{program} {'global_scale' if quant == 'nvfp4' else 'fp8_scale'}={scale!r} "
                            f"poison {poison:#x}")


@pytest.mark.parametrize("value", list(SPECIAL_SCALES))
@pytest.mark.parametrize("profile", ["nvfp4", "fp8_tensor"])
def test_special_device_scale_bytes_follow_the_rule(profile, value, worlds, seed_for, base_seed, record_result):
    """Every world-size-2 program of the profile (one dtype per run) with this scale on every rank."""
    rnd = random.Random(seed_for("plan"))
    dname = rnd.choice(gspec.DTYPES)
    programs = [s.name for s in SPECS if s.world_size == 2 and s.dtype == dname and s.profile == profile]
    assert {gspec.parse(p).family for p in programs} >= {"oneshot", "twoshot", "twoshot_pipelined"}, programs
    world = worlds.get(2, MAX_TOKENS, _hidden(base_seed, 2, dname), ref.NAME_TO_DTYPE[dname])
    arg = "global_scale" if profile == "nvfp4" else "fp8_scale"
    with recording(record_result, cases=0, program=f"ws2 {dname} {profile}", hidden=world.hidden,
                   hostile=f"{arg}={value}") as info:
        for j, program in enumerate(programs):
            T = rnd.choice([rnd.randint(1, 8), rnd.randint(9, 160)])
            for poison, quant_ref_device in zip(POISONS, ("cpu", DEVICE)):  # the rule on the CPU and the GPU
                _special_call(world, program, T, seed_for(f"case{j}"), rnd, SPECIAL_SCALES[value], poison,
                              quant_ref_device)
                info["cases"] += 1


# ---- memory shared between ranks (all ranks in one process) ------------------------------------------

def _run_valid(world, seed, label):
    case = ref.make_case(world.world_size, 7, world.hidden, 3, world.dtype, seed=seed, device=DEVICE)
    provided = ref.alloc_outputs(case)
    outs = world.run([dict(kw, **p) for kw, p in zip(case, provided)])
    torch.cuda.synchronize()
    world.check()
    ref.check_outputs(case, outs, provided, label=label)


def _quant_out_over_global_scale(kws):
    """Rank 1's quant_out in a fresh buffer that also holds rank 0's global_scale."""
    q = kws[1]["quant_out"]
    buf = torch.zeros(q.numel(), dtype=torch.uint8, device=q.device)
    kws[1]["quant_out"] = buf.view(q.shape)
    kws[0]["global_scale"] = buf[64:68].view(torch.float32)


CROSS_RANK = {
    # what: (fn(per-rank kwargs) making the call, the start of the error it must raise)
    "rank 1's norm_out is rank 0's residual_out": (
        lambda kws: kws[1].update(norm_out=kws[0]["residual_out"]),
        r"^per_rank_kwargs\[\d\]: (norm|residual)_out overlaps (norm|residual)_out of per_rank_kwargs\[\d\]"),
    "rank 1's norm_out over rank 0's allreduce_in": (
        lambda kws: kws[1].update(norm_out=kws[0]["allreduce_in"][:kws[1]["residual_in"].shape[0]]),
        r"^per_rank_kwargs\[1\]: norm_out overlaps allreduce_in of per_rank_kwargs\[0\]"),
    "rank 0 in place over a residual_in rank 1 reads too": (
        lambda kws: (kws[1].update(residual_in=kws[0]["residual_in"]),
                     kws[0].update(residual_out=kws[0]["residual_in"])),
        r"^per_rank_kwargs\[0\]: residual_out overlaps residual_in of per_rank_kwargs\[1\]"),
    "rank 1's quant_out over rank 0's global_scale": (
        _quant_out_over_global_scale,
        r"^per_rank_kwargs\[1\]: quant_out overlaps global_scale of per_rank_kwargs\[0\]"),
}


@pytest.mark.parametrize("what", list(CROSS_RANK))
def test_an_output_over_another_ranks_tensor_is_refused(what, worlds, seed_for, base_seed, record_result):
    """Refused before any rank launches (no rank left waiting for its peers), then a valid call works."""
    world = worlds.get(2, MAX_TOKENS, _hidden(base_seed, 2, "bf16"), torch.bfloat16)
    seed = seed_for("case")
    case = ref.make_case(2, 6, world.hidden, 2, world.dtype, seed=seed, device=DEVICE)
    provided = ref.alloc_outputs(case, "nvfp4")
    kws = [dict(kw, **p, quant="nvfp4", global_scale=torch.ones(1, device=DEVICE)) for kw, p in zip(case, provided)]
    make, pattern = CROSS_RANK[what]
    make(kws)
    with recording(record_result, cases=0, program="ws2 bf16 auto", hidden=world.hidden, hostile=what) as info:
        try:
            with pytest.raises(ValueError, match=pattern):
                world.run(kws)
        except BaseException:
            torch.cuda.synchronize()
            world.reset()
            raise
        _run_valid(world, seed + 1, f"valid call after the refused one ({what})")
        info["cases"] = 1
