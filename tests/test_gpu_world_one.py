"""World size 1 on the GPU: dispatch.LocalWorkspace and the local programs against the float64
reference (moe_ar_tools/reference/, whose world size 1 keeps the partial unrounded up to the
residual add, docs/operation.md "World size 1").

What every checked call holds to (reference.check_outputs): outputs poisoned first (NaN, 0xAB
bytes) and every element checked; residual_out inside the per-element bracket of the world-size-1
rule; norm_out inside the bracket of the RMSNorm of the kernel's own residual_out; NVFP4 and FP8
bytes and FP8 scales exactly the rule applied to the kernel's own norm_out, scale padding zero,
bytes past the NVFP4 scale buffer's required length untouched.

Covered: every local program (both dtypes, every profile, FP8-group row and column scales, with and
without power-of-two scales) at T 1, 2, 7, 64, 300, 2048 and H 7168, 4096, 2048, 384 (and 2064,
whose H/16 scale columns need padding, where the profile allows it); top_k 8 with and without the
shared expert; dropped routes (-1) and out-of-range routes (skipped and counted by check());
T = 0; tokens of -0.0; fp32, dtype and no router weights; weight_bias 1; NVFP4's quant_out and scale_out
4, 8 and 12 bytes into 16-byte aligned buffers; CUDA-graph capture and
replays with new values in the captured tensors; PDL, back to back and chained through
residual_in; the torch ops (functional and out, torch.compile with aot_eager and inductor, in a
CUDA graph); the FlashInfer-style entry; program= forcing and selection; hostile calls refused with
a ValueError naming the argument, each followed by a valid call; Workspace(group) of one process;
examples/world_one.py. The latency program's calls of up to 64 tokens run its shape builds (the
default, dispatch/shape_constants.py); their bits against the program's own: a test of its own.

Seeds come from conftest (fresh per run; --seed N reproduces); every failure names its case.
"""
from __future__ import annotations

import itertools
import math
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

import dispatch  # imports without a GPU
from dispatch import op, shape_constants
from gpu_worlds import recording
from moe_ar_tools import reference as ref
from generator import policy
from generator import spec as gspec

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICE = "cuda"
TOKENS = (1, 2, 7, 64, 300, 2048)
HIDDENS = (7168, 4096, 2048, 16 * 3 * 8)
ODD_COLUMN_HIDDEN = 2064  # H/16 = 129 NVFP4 scale columns: the column padding (not a multiple of 128)
MAX_TOKENS = max(TOKENS)
PROGRAMS = [s.name for s in gspec.all_cells() if policy.is_supported(s) and s.world_size == 1]
PROFILE_QUANT = dict(gspec.PROFILE_QUANT)
QUANTS = tuple(PROFILE_QUANT.values())


class _Workspaces:
    """The last LocalWorkspace of a module, kept for the next test with the same sizes."""

    def __init__(self):
        self.key, self.ws = None, None

    def get(self, max_tokens, hidden, dtype):
        if (max_tokens, hidden, dtype) != self.key:
            self.close()
            self.ws = dispatch.LocalWorkspace(max_tokens=max_tokens, hidden=hidden, dtype=dtype)
            self.key = (max_tokens, hidden, dtype)
        return self.ws

    def close(self):
        if self.ws is not None:
            ws, self.ws, self.key = self.ws, None, None
            ws.close()


@pytest.fixture(scope="module")
def workspaces():
    w = _Workspaces()
    yield w
    w.close()


def _quant_args(quant, r0, *, fp8_layout="row", fp8_pow2=False, gs_factor=1.0):
    """(keyword arguments of quant, the scale check_outputs checks against, the fp8 options)."""
    empty = r0["norm_out"].numel() == 0  # T = 0: any scale
    if quant == "nvfp4":
        v = 1.0 if empty else ref.f32(ref.typical_global_scale(r0["norm_out"]) * gs_factor)
        return dict(global_scale=torch.tensor([v], dtype=torch.float32, device=DEVICE)), v, {}
    if quant == "fp8_tensor":
        v = 1.0 if empty else ref.f32(max(float(r0["norm_out"].abs().max()), 1e-3) / ref.E4M3_MAX / gs_factor)
        return dict(fp8_scale=torch.tensor([v], dtype=torch.float32, device=DEVICE)), v, {}
    if quant == "fp8_group128":
        fp8 = dict(fp8_scale_layout=fp8_layout, fp8_pow2_scales=fp8_pow2)
        return dict(fp8), None, fp8
    return {}, None, {}


def _prepare(case, quant, *, program=None, pdl=False, fp8_layout="row", fp8_pow2=False, gs_factor=1.0,
             r0=None, poison_byte=ref.POISON_BYTE):
    """The call's keyword arguments with poisoned outputs given, and what checking it needs."""
    r0 = ref.reference_for(case) if r0 is None else r0
    qargs, scale, fp8 = _quant_args(quant, r0, fp8_layout=fp8_layout, fp8_pow2=fp8_pow2, gs_factor=gs_factor)
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16, poison_byte=poison_byte,
                                 fp8_scale_layout=fp8_layout)
    kwargs = dict(case[0], **provided[0], **qargs, quant=quant, program=program, launch_with_pdl=pdl)
    return dict(case=case, r0=r0, kwargs=kwargs, provided=provided, quant=quant, scale=scale, fp8=fp8,
                poison_byte=poison_byte)


def _check(call, out, label, nvfp4_device=None):
    """check_outputs of one call; the quantized bytes' rule on nvfp4_device (default: the GPU)."""
    ref.check_outputs(call["case"], [out], call["provided"], quant=call["quant"], global_scale=call["scale"],
                      ref=call["r0"], poison_byte=call["poison_byte"], nvfp4_device=nvfp4_device or DEVICE,
                      label=f"world size 1 {label}", **call["fp8"])


def _run_and_check(ws, case, quant, label, nvfp4_device=None, **kw):
    """One call with poisoned outputs given, synchronized, ws.check(), every element checked."""
    call = _prepare(case, quant, **kw)
    out = dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
    torch.cuda.synchronize()
    ws.check()
    _check(call, out, label, nvfp4_device)
    return call, out


def _case(T, H, dtype, seed, rnd=None, **kw):
    """make_case at world size 1 on the GPU; unset options drawn from rnd (or the defaults)."""
    if rnd is not None:
        kw.setdefault("top_k", rnd.choice([1, 2, 5, 8, 8]))
        kw.setdefault("scale_kind", rnd.choice([None, "fp32", "dtype"]))
        kw.setdefault("shared", rnd.random() < 0.7)
        kw.setdefault("rsf", rnd.choice([1.0, ref.f32(rnd.uniform(0.5, 2.5))]))
        kw.setdefault("weight_bias", rnd.randint(0, 1))
        kw.setdefault("padded_rows", rnd.choice([0, 5]))
        kw.setdefault("drop_frac", rnd.choice([0.0, 0.15]))
    top_k = kw.pop("top_k", 8)
    return ref.make_case(1, T, H, top_k, dtype, seed=seed, device=DEVICE, **kw)


# ---- every local program --------------------------------------------------------------------------

@pytest.mark.parametrize("program", PROGRAMS)
def test_every_local_program_matches_the_reference(program, workspaces, seed_for, record_result):
    """Forced, at every T and H of the plan; top_k 8 with the shared expert first, then without,
    then drawn; fp8_group128 cycles through both scale layouts with and without power-of-two scales;
    PDL on every other call."""
    s = gspec.parse(program)
    assert program in dispatch.programs(), f"{program} is a supported cell but dispatch does not list it"
    dtype = ref.NAME_TO_DTYPE[s.dtype]
    quant = PROFILE_QUANT[s.profile]
    hiddens = HIDDENS + (() if quant == "fp8_group128" else (ODD_COLUMN_HIDDEN,))
    rnd = random.Random(seed_for("plan"))
    with recording(record_result, cases=0, program=program) as info:
        i = 0
        for H in hiddens:
            ws = workspaces.get(MAX_TOKENS, H, dtype)
            for T in TOKENS:
                options = dict(top_k=8, shared=True) if i % 3 == 0 else dict(top_k=8, shared=False) \
                    if i % 3 == 1 else {}
                case = _case(T, H, dtype, seed_for(f"case{i}"), rnd, **options)
                _run_and_check(ws, case, quant, f"{program} H={H} T={T} case {i}", program=program, pdl=i % 2 == 1,
                               nvfp4_device="cpu" if T <= 7 and H <= 4096 else DEVICE,
                               fp8_layout=("row", "column")[i % 2], fp8_pow2=(i // 2) % 2 == 1,
                               gs_factor=rnd.choice([1.0, 1.0, 4.0, 1e-3]))
                info["cases"] += 1
                i += 1


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("dname", gspec.DTYPES)
def test_selection_is_local_for_every_token_count(dname, quant, workspaces, seed_for):
    """Automatic selection at world size 1: the profile's latency program (local) up to the tables'
    local_max_tokens or its one wave of blocks, the streaming one up to streaming_max_tokens, the
    latency one again above (the exchange rungs' hole fallback), with or without a shared operand; a
    call without program= runs it (checked output). H 5120: a row the committed tables did not measure,
    whose latency range the wave ends (one 320-thread block a multiprocessor)."""
    from dispatch.launcher import launcher_for
    dtype = ref.NAME_TO_DTYPE[dname]
    profile = next(name for name, q in PROFILE_QUANT.items() if q == quant)
    for H in (2048, 5120):
        ws = workspaces.get(MAX_TOKENS, H, dtype)
        _check_selection(ws, dname, profile, quant, launcher_for(ws, f"moe_ar_local_{dname}_ws1_{profile}"))
    ws = workspaces.get(MAX_TOKENS, 2048, dtype)
    for i, (T, top_k) in enumerate(((1, 8), (257, 8), (MAX_TOKENS, 8), (257, 2), (384, 1))):
        case = _case(T, 2048, dtype, seed_for(f"case{i}"), shared=i % 2 == 0, top_k=top_k)
        call = _prepare(case, quant)
        ran = op.prepare_call(ws, dict(call["kwargs"])).plan.launcher.name
        assert ran == dispatch.select_program(ws, T, quant, i % 2 == 0, top_k=top_k), (T, top_k, ran)
        _run_and_check(ws, case, quant, f"automatic T={T} top_k={top_k}")


def _check_selection(ws, dname, profile, quant, latency):
    """select_program against the rule: the table's latency range, cut at the latency program's one
    wave of blocks and, for calls the streaming program runs as its few-routes build, at
    shape_constants.FEW_ROUTES_LATENCY_MAX_TOKENS."""
    limits = ws.selection.limits(profile)
    wave = latency.one_wave_tokens()
    if ws.hidden == 5120:
        assert wave < limits["local_max_tokens"], (wave, limits)  # what this case is for
    few = (shape_constants.enabled() and ws.vec_per_thread is None and profile in shape_constants.FEW_ROUTES_PROFILES
           and ws.hidden <= shape_constants.FEW_ROUTES_MAX_HIDDEN)
    for top_k in (None, 1, 2, 3, 8):
        latency_end = min(limits["local_max_tokens"], wave)
        if few and top_k is not None and top_k <= shape_constants.FEW_ROUTES_MAX_TOP_K:
            latency_end = min(latency_end, shape_constants.FEW_ROUTES_LATENCY_MAX_TOKENS)
        for T in range(1, MAX_TOKENS + 1):
            streaming = latency_end < T <= limits["streaming_max_tokens"]
            want = gspec.ProgramSpec("local_streaming" if streaming else "local", dname, 1, profile).name
            for shared in (False, True):
                got = dispatch.select_program(ws, T, quant, shared, top_k=top_k)
                assert got == want, (f"H={ws.hidden} T={T} top_k={top_k} shared={shared} quant={quant}: selected "
                                     f"{got}, expected {want}")


# ---- routes and special inputs --------------------------------------------------------------------

@pytest.mark.parametrize("family", ["local", "local_streaming"])
@pytest.mark.parametrize("quant", QUANTS)
def test_out_of_range_routes_are_skipped_and_counted(quant, family, workspaces, seed_for):
    """Routes with an index >= allreduce_in.shape[0] add nothing (the reference skips them as dropped
    routes) and are counted: check() raises naming the number of 16-byte row loads left out (H / 8 per
    route), reset() clears the count, and a valid call afterwards is correct. Both layouts (the
    streaming one counts a skipped route once a row, not once a vector)."""
    H, T, K = 4096, 37, 8
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    ws.reset()  # count from zero
    rnd = random.Random(seed_for("plan"))
    case = _case(T, H, torch.bfloat16, seed_for("case"), top_k=K, shared=True, scale_kind="fp32", drop_frac=0.1,
                 padded_rows=3)
    kw = case[0]
    idx = kw["expanded_idx_to_permuted_idx"]
    R = kw["allreduce_in"].shape[0]
    live = (idx >= 0).nonzero().tolist()
    bad = rnd.sample(live, 9)
    expected = ref.Case([dict(kw, expanded_idx_to_permuted_idx=idx.clone())], case.meta)
    for t, k in bad:  # what the reference computes: the route adds nothing, as a dropped one
        expected[0]["expanded_idx_to_permuted_idx"][t, k] = -1
        idx[t, k] = R + rnd.choice([0, 1, 1000, 2 ** 31 - 1 - R])
    program = gspec.ProgramSpec(family, "bf16", 1, next(n for n, q in PROFILE_QUANT.items() if q == quant)).name
    call = _prepare(expected, quant, program=program)
    call["kwargs"]["expanded_idx_to_permuted_idx"] = idx
    out = dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=rf"rank 0: routes had an expanded_idx_to_permuted_idx entry >= "
                                           rf"allreduce_in.shape\[0\]; they were skipped \({len(bad) * H // 8} "
                                           rf"16-byte row loads"):
        ws.check()
    _check(call, out, f"{len(bad)} out-of-range routes")
    ws.reset()
    ws.check()  # the count is cleared
    _run_and_check(ws, _case(T, H, torch.bfloat16, seed_for("after")), quant, "after reset", program=program)


def test_zero_tokens_launches_nothing_and_returns_empty_outputs(workspaces):
    """T = 0: no launch, outputs of T = 0 rows (allocated, or the given empty ones), as at the other
    world sizes; the workspace keeps working."""
    H = 2048
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    for quant in QUANTS:
        case = _case(0, H, torch.bfloat16, 7, top_k=4)
        call = _prepare(case, quant, fp8_layout="column")
        given = dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
        kw = {k: v for k, v in call["kwargs"].items() if k not in ("norm_out", "residual_out", "quant_out", "scale_out")}
        allocated = dispatch.moe_finalize_allreduce(ws, **kw)
        torch.cuda.synchronize()
        ws.check()
        for out in (given, allocated):
            assert tuple(out.norm_out.shape) == (0, H) and tuple(out.residual_out.shape) == (0, H), (quant, out)
            if quant is None:
                assert out.quant_out is None and out.scale_out is None, quant
            else:
                assert out.quant_out is not None and out.quant_out.shape[0] == 0, (quant, out.quant_out.shape)
        assert given.norm_out is call["provided"][0]["norm_out"], "the given norm_out is not the one returned"
    _run_and_check(ws, _case(5, H, torch.bfloat16, 8), None, "after T = 0")


@pytest.mark.parametrize("quant", QUANTS)
def test_negative_zero_tokens(quant, workspaces, seed_for):
    """Tokens whose routed rows, shared row and residual are all -0.0 (also with a negative
    routed_scaling_factor, and with every route dropped): residual_out is +0.0, bit for bit (the sum
    starts from +0.0, as at the other world sizes), and every output follows the rule."""
    H, T = 2048, 9
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    for rsf in (1.0, -1.5):
        case = _case(T, H, torch.bfloat16, seed_for(f"case{rsf}"), top_k=4, shared=True, scale_kind="fp32",
                     rsf=rsf, drop_frac=0.0)
        kw = case[0]
        idx = kw["expanded_idx_to_permuted_idx"]
        zeros = (0, 3, 8)
        for t in zeros:
            kw["allreduce_in"][idx[t].long()] = -0.0
            kw["shared_expert_output"][t] = -0.0
            kw["residual_in"][t] = -0.0
        idx[3] = -1  # token 3: every route dropped
        call, out = _run_and_check(ws, case, quant, f"-0.0 tokens rsf={rsf}")
        bits = out.residual_out.view(torch.int16)[list(zeros)]
        assert (bits == 0).all(), f"rsf={rsf}: residual_out of the -0.0 tokens is not +0.0: {bits.unique().tolist()}"


@pytest.mark.parametrize("scale_kind", [None, "fp32", "dtype"])
@pytest.mark.parametrize("weight_bias", [0, 1])
def test_router_weights_and_weight_bias(scale_kind, weight_bias, workspaces, seed_for):
    """fp32, dtype and no router weights (= 1), weight_bias 0 and 1, with NaN on dropped routes'
    weights (never read), both dtypes, two profiles."""
    for dname in gspec.DTYPES:
        dtype = ref.NAME_TO_DTYPE[dname]
        ws = workspaces.get(MAX_TOKENS, 4096, dtype)
        for i, (T, quant) in enumerate(((3, None), (129, "nvfp4"), (300, "fp8_group128"))):
            case = _case(T, 4096, dtype, seed_for(f"{dname}{i}"), top_k=8, scale_kind=scale_kind,
                         weight_bias=weight_bias, shared=i != 1, rsf=ref.f32(0.75), drop_frac=0.2)
            scale = case[0]["expert_scale_factor"]
            if scale is not None:
                scale[case[0]["expanded_idx_to_permuted_idx"] < 0] = math.nan
            _run_and_check(ws, case, quant, f"{dname} scale={scale_kind} weight_bias={weight_bias} T={T}")


def test_residual_out_may_be_residual_in(workspaces, seed_for):
    """In place: residual_out given as residual_in itself, every profile, both layouts (the streaming
    one copies residual_in into shared memory ahead of writing residual_out), against the reference of
    a copy of residual_in taken before the call."""
    ws = workspaces.get(MAX_TOKENS, 7168, torch.bfloat16)
    rnd = random.Random(seed_for("plan"))
    for i, (quant, family) in enumerate(itertools.product(QUANTS, ("local", "local_streaming"))):
        profile = next(n for n, q in PROFILE_QUANT.items() if q == quant)
        program = gspec.ProgramSpec(family, "bf16", 1, profile).name
        for T in (rnd.randint(1, 16), rnd.randint(257, MAX_TOKENS)):
            case = _case(T, 7168, torch.bfloat16, seed_for(f"case{i}.{T}"), rnd)
            pristine = ref.Case([dict(case[0], residual_in=case[0]["residual_in"].clone())], case.meta)
            call = _prepare(pristine, quant, fp8_layout="column", fp8_pow2=True, program=program)
            call["kwargs"]["residual_in"] = call["kwargs"]["residual_out"] = case[0]["residual_in"]
            call["provided"][0]["residual_out"] = case[0]["residual_in"]
            out = dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
            torch.cuda.synchronize()
            ws.check()
            assert out.residual_out.data_ptr() == case[0]["residual_in"].data_ptr()
            _check(call, out, f"in place {program} T={T}")


@pytest.mark.parametrize("offset", [4, 8, 12])
def test_nvfp4_outputs_need_only_be_four_byte_aligned(offset, workspaces, seed_for):
    """NVFP4's quant_out and scale_out are views `offset` bytes into 16-byte aligned buffers (the API
    asks 4-byte alignment of both): both programs, both dtypes, the cluster, one-block and streaming
    layouts, H 7168 and 2064 (its scale columns padded too): the rule's bytes and scales, zero padding,
    the poisoned bytes past scale_out's required length untouched, and the buffers' bytes before the
    views untouched."""
    for dname, H in itertools.product(gspec.DTYPES, (7168, ODD_COLUMN_HIDDEN)):
        dtype = ref.NAME_TO_DTYPE[dname]
        ws = workspaces.get(MAX_TOKENS, H, dtype)
        for family, T in itertools.product(("local", "local_streaming"), (1, 48, 130, MAX_TOKENS)):
            program = gspec.ProgramSpec(family, dname, 1, "nvfp4").name
            case = _case(T, H, dtype, seed_for(f"{dname}{H}{family}{T}"), top_k=8, shared=T % 2 == 0)
            call = _prepare(case, "nvfp4", program=program)
            buffers = {}
            for name in ("quant_out", "scale_out"):
                given = call["provided"][0][name]
                buffers[name] = torch.full((offset + given.numel(),), ref.POISON_BYTE, dtype=torch.uint8,
                                           device=DEVICE)
                assert buffers[name].data_ptr() % 16 == 0
                view = buffers[name][offset:].view(given.shape)
                call["provided"][0][name] = call["kwargs"][name] = view
            out = dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
            torch.cuda.synchronize()
            ws.check()
            label = f"quant_out and scale_out at +{offset} {program} H={H} T={T}"
            for name, buffer in buffers.items():
                assert getattr(out, name).data_ptr() == buffer.data_ptr() + offset, f"{label}: {name}"
                assert bool((buffer[:offset] == ref.POISON_BYTE).all()), f"{label}: bytes before {name}"
            _check(call, out, label)


# ---- PDL and CUDA graphs --------------------------------------------------------------------------

def test_pdl_back_to_back_and_chained(workspaces, seed_for):
    """Calls launched with launch_with_pdl=True back to back with no synchronization between them:
    independent calls of every profile, then a chain in which each call's residual_in is the
    previous call's residual_out: the next kernel may start early, but must read what the previous
    one wrote. Every call is checked afterwards, each link against the reference of the residual the
    previous kernel produced."""
    H = 4096
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    rnd = random.Random(seed_for("plan"))
    calls = [_prepare(_case(rnd.choice([1, 7, 64, 300, 2048]), H, torch.bfloat16, seed_for(f"call{i}"), rnd),
                      QUANTS[i % len(QUANTS)], pdl=True, fp8_layout=("row", "column")[i % 2]) for i in range(12)]
    outs = [dispatch.moe_finalize_allreduce(ws, **call["kwargs"]) for call in calls]  # no synchronization between
    torch.cuda.synchronize()
    ws.check()
    for i, (call, out) in enumerate(zip(calls, outs)):
        _check(call, out, f"back to back with PDL, call {i} of {len(calls)}")
    T = 300
    links = [_case(T, H, torch.bfloat16, seed_for(f"link{j}"), rnd, top_k=8, shared=j % 2 == 0) for j in range(8)]
    provided = [ref.alloc_outputs(case)[0] for case in links]
    for j, case in enumerate(links):  # link j reads link j - 1's residual_out
        if j:
            case[0]["residual_in"] = provided[j - 1]["residual_out"]
    outs = [dispatch.moe_finalize_allreduce(ws, **case[0], **p, launch_with_pdl=True)
            for case, p in zip(links, provided)]
    torch.cuda.synchronize()
    ws.check()
    for j, (case, out, p) in enumerate(zip(links, outs, provided)):
        ref.check_outputs(case, [out], [p], label=f"world size 1 PDL chain, link {j} of {len(links)}")


@pytest.mark.parametrize("T", [100, MAX_TOKENS])
def test_pdl_chain_on_the_streaming_program(T, workspaces, seed_for):
    """A chain of PDL calls on the streaming program, each link's residual_in the previous link's
    residual_out: at 100 tokens its grid leaves block slots free and it lets the next kernel launch
    only when its blocks exit; at 2,048 its grid fills every slot and it lets it launch at its start
    (kernels/local.cuh, run_local). Either way each link must read what the previous one wrote."""
    H = 4096
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    rnd = random.Random(seed_for(f"plan{T}"))
    links = [_case(T, H, torch.bfloat16, seed_for(f"link{T}-{j}"), rnd, top_k=8, shared=j % 2 == 0) for j in range(6)]
    provided = [ref.alloc_outputs(case)[0] for case in links]
    for j, case in enumerate(links):  # link j reads link j - 1's residual_out
        if j:
            case[0]["residual_in"] = provided[j - 1]["residual_out"]
    outs = [dispatch.moe_finalize_allreduce(ws, **case[0], **p, launch_with_pdl=True,
                                            program="moe_ar_local_streaming_bf16_ws1_plain")
            for case, p in zip(links, provided)]
    torch.cuda.synchronize()
    ws.check()
    for j, (case, out, p) in enumerate(zip(links, outs, provided)):
        ref.check_outputs(case, [out], [p], label=f"world size 1 PDL chain on the streaming program, T={T}, "
                                                  f"link {j} of {len(links)}")


def _refresh(case, seed):
    """New random values, routing included, into the case's tensors (same shapes and options)."""
    m = case.meta
    fresh = ref.make_case(1, m["tokens"], m["hidden"], m["top_k"], m["dtype"], seed=seed, device=DEVICE,
                          shared=m["shared"], scale_kind=m["scale_kind"], rsf=m["rsf"], weight_bias=m["weight_bias"],
                          padded_rows=m["padded_rows"], drop_frac=m["drop_frac"])
    for k, v in case[0].items():
        if isinstance(v, torch.Tensor):
            v.copy_(fresh[0][k])
    return case


@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_replays_with_new_values(pdl, workspaces, seed_for, record_result):
    """One graph of four calls (every profile, T across the row-split boundary), captured after an
    eager call of each; replayed with fresh values copied into the captured inputs and device scales,
    outputs poisoned before every replay, eager calls of other T in between."""
    H = 2048
    ws = workspaces.get(MAX_TOKENS, H, torch.float16)
    rnd = random.Random(seed_for("plan"))
    slots = []
    for i, (T, quant) in enumerate(((1, "nvfp4"), (64, None), (257, "fp8_group128"), (2048, "fp8_tensor"))):
        case = _case(T, H, torch.float16, seed_for(f"static{i}"), rnd)
        call = _prepare(case, quant, pdl=pdl, fp8_layout="column", fp8_pow2=i % 2 == 0)
        out = dispatch.moe_finalize_allreduce(ws, **call["kwargs"])  # eager: program loaded, plan built
        torch.cuda.synchronize()
        _check(call, out, f"eager before capture T={T}")
        slots.append(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [dispatch.moe_finalize_allreduce(ws, **call["kwargs"]) for call in slots]
    torch.cuda.synchronize()
    with recording(record_result, cases=0, program=f"local graph pdl={pdl}") as info:
        for rep in range(24):
            for j, call in enumerate(slots):
                _refresh(call["case"], seed_for(f"replay{rep}.{j}"))
                call["r0"] = ref.reference_for(call["case"])
                qargs, scale, _ = _quant_args(call["quant"], call["r0"])
                for name in ("global_scale", "fp8_scale"):
                    if name in qargs:
                        call["kwargs"][name].copy_(qargs[name])
                call["scale"] = scale
                ref.repoison(call["provided"][0])
            graph.replay()
            torch.cuda.synchronize()
            ws.check()
            for j, (call, out) in enumerate(zip(slots, outs)):
                _check(call, out, f"replay {rep} slot {j} T={call['case'].meta['tokens']} pdl={pdl}")
                info["cases"] += 1
            if rep % 4 == 3:
                T = rnd.randint(1, MAX_TOKENS)
                _run_and_check(ws, _case(T, H, torch.float16, seed_for(f"eager{rep}"), rnd), rnd.choice(QUANTS),
                               f"eager between replays T={T}", pdl=rnd.random() < 0.5)


# ---- the torch ops and the FlashInfer-style entry -------------------------------------------------

def test_torch_ops_functional_and_out(workspaces, seed_for):
    """torch.ops.moe_ar.moe_finalize_allreduce (new tensors) and _out (given, poisoned outputs)
    through dispatch.workspace_handle(ws), every profile, checked in full; the functional op's
    empty quant outputs for quant=None."""
    H = 4096
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    h = dispatch.workspace_handle(ws)
    assert dispatch.workspace_from_handle(h) is ws
    rnd = random.Random(seed_for("plan"))
    names = ("allreduce_in", "expanded_idx_to_permuted_idx", "residual_in", "norm_weight")
    for i, quant in enumerate(QUANTS):
        for T in (rnd.randint(1, 64), rnd.randint(257, MAX_TOKENS)):
            call = _prepare(_case(T, H, torch.bfloat16, seed_for(f"case{i}.{T}"), rnd), quant, fp8_layout="column")
            kw = dict(call["kwargs"])
            outputs = [kw.pop(n, None) for n in ("norm_out", "residual_out", "quant_out", "scale_out")]
            inputs = [kw.pop(n) for n in names]
            torch.ops.moe_ar.moe_finalize_allreduce_out(h, *inputs, *outputs, **kw)
            torch.cuda.synchronize()
            ws.check()
            _check(call, dispatch.MoeFinalizeOutputs(*outputs), f"out op quant={quant} T={T}")
            norm, residual, q, s = torch.ops.moe_ar.moe_finalize_allreduce(h, *inputs, **kw)
            torch.cuda.synchronize()
            if quant is None:
                assert q.numel() == 0 and s.numel() == 0, (q.shape, s.shape)
                q = s = None
            elif quant == "fp8_tensor":
                assert s.numel() == 0, s.shape
                s = None
            functional = dispatch.MoeFinalizeOutputs(norm, residual, q, s)
            ref.check_outputs(call["case"], [functional], quant=quant, global_scale=call["scale"], ref=call["r0"],
                              nvfp4_device=DEVICE, label=f"world size 1 functional op quant={quant} T={T}",
                              **call["fp8"])


def _tail(h, allreduce_in, expanded_idx_to_permuted_idx, residual_in, norm_weight, scale_bf16, shared, rsf: float,
          quant, global_scale):
    """The compiled function: a compiled conversion feeding the op (bf16 router weights to fp32, exact)."""
    return dispatch.moe_finalize_allreduce_op(
        h, allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
        residual_in=residual_in, norm_weight=norm_weight, expert_scale_factor=scale_bf16.float(),
        routed_scaling_factor=rsf, shared_expert_output=shared, eps=1e-6, quant=quant, global_scale=global_scale)


@pytest.mark.parametrize("quant", [None, "nvfp4"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_op_in_cuda_graph(backend, quant, workspaces, seed_for, record_result):
    """torch.compile(fullgraph=True, dynamic=True) of a function calling the op on a LocalWorkspace:
    eager-compiled calls at two T, then one CUDA graph of both, replayed with fresh values copied
    into the captured inputs (and global scale), every replay checked."""
    if backend == "inductor":
        from torch.utils._triton import has_triton
        if not has_triton():
            pytest.skip("inductor needs triton")
    import torch._inductor.config as inductor_config
    H = 2048
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    h = dispatch.workspace_handle(ws)
    torch._dynamo.reset()
    fn = torch.compile(_tail, backend=backend, fullgraph=True, dynamic=True)
    rnd = random.Random(seed_for("plan"))
    slots = [dict(T=T, rsf=ref.f32(rnd.uniform(0.5, 2.0))) for T in (rnd.randint(2, 64), rnd.randint(300, 2048))]

    def fresh(slot, seed):
        case = _case(slot["T"], H, torch.bfloat16, seed, top_k=4, scale_kind="fp32", shared=True, rsf=slot["rsf"],
                     weight_bias=0, drop_frac=0.2, padded_rows=3)
        kw = case[0]
        kw["expert_scale_factor"] = kw["expert_scale_factor"].to(torch.bfloat16).float()  # exact in bf16
        gs = ref.f32(ref.typical_global_scale(ref.reference_for(case)["norm_out"])) if quant else None
        return case, gs

    def inputs(case, gs_t):
        kw = case[0]
        return dict(allreduce_in=kw["allreduce_in"], expanded_idx_to_permuted_idx=kw["expanded_idx_to_permuted_idx"],
                    residual_in=kw["residual_in"], norm_weight=kw["norm_weight"],
                    scale_bf16=kw["expert_scale_factor"].to(torch.bfloat16), shared=kw["shared_expert_output"],
                    rsf=case.meta["rsf"], quant=quant, global_scale=gs_t if quant else None)

    def check(case, gs, out, label):
        torch.cuda.synchronize()
        ws.check()
        ref.check_outputs(case, [out], quant=quant, global_scale=gs, nvfp4_device=DEVICE,
                          label=f"world size 1 {backend} {label}")

    with inductor_config.patch({"triton.autotune_pointwise": False}), \
            recording(record_result, cases=0, program=f"local compiled {backend} quant={quant}") as info:
        for i, slot in enumerate(slots):
            case, gs = fresh(slot, seed_for(f"warm{i}"))
            slot.update(case=case, gs_t=torch.tensor([gs if quant else 1.0], dtype=torch.float32, device=DEVICE))
            slot["kw"] = inputs(case, slot["gs_t"])
            check(case, gs, fn(h, **slot["kw"]), f"compiled eager T={slot['T']}")
            info["cases"] += 1
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for slot in slots:
                slot["out"] = fn(h, **slot["kw"])
        torch.cuda.synchronize()
        for rep in range(6):
            for j, slot in enumerate(slots):
                case, gs = fresh(slot, seed_for(f"replay{rep}.{j}"))
                for k, v in slot["case"][0].items():
                    if isinstance(v, torch.Tensor):
                        v.copy_(case[0][k])
                slot["kw"]["scale_bf16"].copy_(case[0]["expert_scale_factor"].to(torch.bfloat16))
                if quant:
                    slot["gs_t"].fill_(gs)
                for t in slot["out"]:
                    if t is not None:
                        t.fill_(math.nan if t.is_floating_point() else 0xAB)
                slot["fresh"] = (case, gs)
            graph.replay()
            for slot in slots:
                check(*slot["fresh"], slot["out"], f"replay {rep} T={slot['T']}")
                info["cases"] += 1


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_flashinfer_entry(quant, workspaces, seed_for):
    """FlashInfer's argument list with world_rank 0 and world_size 1, outputs given: written in place
    and inside the world-size-1 rule; world_rank or world_size other than 0 / 1 is refused by name."""
    H = 4096
    ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
    rnd = random.Random(seed_for("plan"))
    for i, T in enumerate((1, rnd.randint(2, 64), rnd.randint(257, MAX_TOKENS))):
        case = _case(T, H, torch.bfloat16, seed_for(f"case{i}"), top_k=8, scale_kind="fp32", shared=i % 2 == 0,
                     rsf=ref.f32(2.5), weight_bias=i % 2)
        call = _prepare(case, quant)
        kw, p = case[0], call["provided"][0]
        args = (kw["allreduce_in"], kw["residual_in"], kw["norm_weight"], kw["expanded_idx_to_permuted_idx"],
                p["norm_out"], p["residual_out"], p.get("quant_out"), p.get("scale_out"))
        gs_t = call["kwargs"].get("global_scale")
        for name, rank, size in (("world_rank", 1, 1), ("world_size", 0, 2)):
            with pytest.raises(ValueError, match=f"^{name}: "):
                dispatch.trtllm_moe_finalize_allreduce_fusion(
                    *args, ws, False, rank, size, kw["eps"], kw["shared_expert_output"], kw["expert_scale_factor"],
                    kw["routed_scaling_factor"], float(kw["weight_bias"]), global_scale=gs_t)
        out = dispatch.trtllm_moe_finalize_allreduce_fusion(
            *args, ws if i != 1 else dispatch.workspace_handle(ws), i == 2, 0, 1, kw["eps"], kw["shared_expert_output"],
            kw["expert_scale_factor"], kw["routed_scaling_factor"], float(kw["weight_bias"]), global_scale=gs_t)
        torch.cuda.synchronize()
        ws.check()
        _check(call, out, f"flashinfer entry T={T}")


# ---- program= and hostile calls -------------------------------------------------------------------

def test_program_forcing(workspaces, seed_for):
    """program= the local program runs it; a program of another world size, dtype or profile is a
    ValueError naming program, and nothing is launched (the next call is correct)."""
    ws = workspaces.get(MAX_TOKENS, 2048, torch.bfloat16)
    case = _case(5, 2048, torch.bfloat16, seed_for("case"))
    _run_and_check(ws, case, "nvfp4", "forced local", program="moe_ar_local_bf16_ws1_nvfp4")
    for other, why in (("moe_ar_oneshot_bf16_ws2_nvfp4", "world size 2"), ("moe_ar_local_fp16_ws1_nvfp4", "another dtype"),
                       ("moe_ar_local_bf16_ws1_plain", "another profile"), ("moe_ar_local_bf16_ws3_plain", "no such program")):
        call = _prepare(case, "nvfp4", program=other)
        with pytest.raises(ValueError, match="^program: "):
            dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
        _run_and_check(ws, _case(6, 2048, torch.bfloat16, seed_for(why)), "nvfp4", f"after refusing {other} ({why})")


def _residual_out_half_over_residual_in(kw):
    T, H = kw["residual_in"].shape
    buf = torch.empty((T + 1) * H, dtype=kw["residual_in"].dtype, device=DEVICE)
    kw["residual_in"] = buf[: T * H].view(T, H).copy_(kw["residual_in"])
    kw["residual_out"] = buf[H // 2: H // 2 + T * H].view(T, H)  # half a row further: overlapping, not it


def _norm_out_over_norm_weight(kw):
    T, H = kw["norm_out"].shape
    buf = torch.empty((T + 1) * H, dtype=kw["norm_out"].dtype, device=DEVICE)
    kw["norm_out"] = buf[: T * H].view(T, H)
    kw["norm_weight"] = buf[T * H - 8: T * H - 8 + H].copy_(kw["norm_weight"])  # its first 8 elements in norm_out


def _setk(name, value):
    def make(kw):
        kw[name] = value(kw) if callable(value) else value
    return make


# (label, fn(kwargs) making the call bad, the argument the ValueError must start with)
HOSTILE = [
    ("norm_out is residual_out", lambda kw: kw.update(norm_out=kw["residual_out"]), "norm_out"),
    ("norm_out over allreduce_in", _setk("norm_out", lambda kw: kw["allreduce_in"][: kw["norm_out"].shape[0]]),
     "norm_out"),
    ("norm_out over norm_weight", _norm_out_over_norm_weight, "norm_out"),
    ("residual_out half over residual_in", _residual_out_half_over_residual_in, "residual_out"),
    ("quant_out over residual_in", lambda kw: kw.update(
        quant="fp8_tensor", fp8_scale=torch.ones(1, device=DEVICE),
        quant_out=kw["residual_in"].view(-1).view(torch.float8_e4m3fn)[: kw["residual_in"].numel()]
        .view(kw["residual_in"].shape)), "quant_out"),
    ("eps NaN", _setk("eps", math.nan), "eps"),
    ("eps 0", _setk("eps", 0.0), "eps"),
    ("routed_scaling_factor inf", _setk("routed_scaling_factor", math.inf), "routed_scaling_factor"),
    ("routed_scaling_factor NaN", _setk("routed_scaling_factor", math.nan), "routed_scaling_factor"),
    ("weight_bias True", _setk("weight_bias", True), "weight_bias"),
    ("global_scale with quant=None", _setk("global_scale", lambda kw: torch.ones(1, device=DEVICE)), "global_scale"),
    ("fp8_scale with quant=None", _setk("fp8_scale", lambda kw: torch.ones(1, device=DEVICE)), "fp8_scale"),
    ("fp8_scale_layout column with quant=None", _setk("fp8_scale_layout", "column"), "fp8_scale_layout"),
    ("fp8_pow2_scales with quant=None", _setk("fp8_pow2_scales", True), "fp8_pow2_scales"),
    ("quant_out with quant=None", _setk("quant_out", lambda kw: torch.empty(
        kw["residual_in"].shape[0], kw["residual_in"].shape[1] // 2, dtype=torch.uint8, device=DEVICE)), "quant_out"),
    ("residual_in of the other dtype", _setk("residual_in", lambda kw: kw["residual_in"].to(torch.float16)),
     "residual_in"),
    ("allreduce_in on the CPU", _setk("allreduce_in", lambda kw: kw["allreduce_in"].cpu()), "allreduce_in"),
    ("norm_weight not contiguous", _setk("norm_weight", lambda kw: torch.stack([kw["norm_weight"]] * 2, 1)[:, 0]),
     "norm_weight"),
    ("index int64", _setk("expanded_idx_to_permuted_idx", lambda kw: kw["expanded_idx_to_permuted_idx"].long()),
     "expanded_idx_to_permuted_idx"),
    ("top_k 17", _setk("expanded_idx_to_permuted_idx", lambda kw: torch.zeros(
        kw["residual_in"].shape[0], 17, dtype=torch.int32, device=DEVICE)), "expanded_idx_to_permuted_idx"),
    ("more tokens than max_tokens", _setk("expanded_idx_to_permuted_idx", lambda kw: torch.zeros(
        MAX_TOKENS + 1, 2, dtype=torch.int32, device=DEVICE)), "expanded_idx_to_permuted_idx"),
    ("an unknown argument", _setk("world_size", 1), "world_size"),
    ("an unknown quant", _setk("quant", "int8"), "quant"),
]


@pytest.mark.parametrize("label,make,name", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_call_is_refused_by_name(label, make, name, workspaces, seed_for):
    """A bad call raises ValueError naming the argument before anything is launched; the next valid
    call is correct (a launched kernel would have written the outputs it then checks)."""
    ws = workspaces.get(MAX_TOKENS, 2048, torch.bfloat16)
    case = _case(11, 2048, torch.bfloat16, seed_for("case"), top_k=4, shared=True, scale_kind="fp32")
    kw = dict(_prepare(case, None)["kwargs"])
    make(kw)
    with pytest.raises(ValueError, match=f"^{name}: "):
        dispatch.moe_finalize_allreduce(ws, **kw)
    _run_and_check(ws, _case(11, 2048, torch.bfloat16, seed_for("valid")), "fp8_group128",
                   f"valid call after refusing: {label}", fp8_layout="column")


# ---- workspaces ------------------------------------------------------------------------------------

def test_workspace_of_a_one_process_group_is_local(tmp_path, seed_for):
    """dispatch.Workspace(group) with a group of one process: the world-size-1 memory and programs,
    no buffers and no rendezvous; calls, check(), reset() and close() work."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ws = dispatch.Workspace(dist.group.WORLD, max_tokens=64, hidden=2048, dtype=torch.bfloat16)
        try:
            assert (ws.world_size, ws.rank, ws.backend, ws.buffer_elems) == (1, 0, "local", 0), \
                (ws.world_size, ws.rank, ws.backend, ws.buffer_elems)
            assert ws.peer_buffer_ptrs == [0] * len(ws.peer_buffer_ptrs)
            for i, quant in enumerate(QUANTS):
                _run_and_check(ws, _case(3 + 20 * i, 2048, torch.bfloat16, seed_for(f"case{i}")), quant,
                               f"Workspace(group of 1) quant={quant}")
            ws.reset()
            ws.check()
        finally:
            ws.close()
        with pytest.raises(ValueError, match="^workspace: "):
            _run_and_check(ws, _case(3, 2048, torch.bfloat16, 1), None, "closed")
    finally:
        dist.destroy_process_group()


def test_local_workspace_lifetime_and_devices(seed_for):
    """LocalWorkspace on a device given by index, "cuda:i" and torch.device; a with block closes it;
    dispatch.check() covers it while it lives; a call on a closed one is refused by name."""
    index = torch.cuda.current_device()
    for device in (index, f"cuda:{index}", torch.device("cuda", index), None):
        with dispatch.LocalWorkspace(max_tokens=16, hidden=384, dtype=torch.float16, device=device) as ws:
            assert (ws.world_size, ws.rank, ws.device_index) == (1, 0, index), (device, ws.device_index)
            _run_and_check(ws, _case(16, 384, torch.float16, seed_for(str(device))), "nvfp4", f"device={device!r}")
            assert ws in dispatch.workspace._live_workspaces  # what dispatch.check() checks
        with pytest.raises(ValueError, match="^workspace: "):
            dispatch.moe_finalize_allreduce(ws, **_prepare(_case(2, 384, torch.float16, 3), None)["kwargs"])
        ws.close()  # idempotent
    with pytest.raises(ValueError, match="^device: "):
        dispatch.LocalWorkspace(max_tokens=16, hidden=384, dtype=torch.float16, device=torch.cuda.device_count())


def test_example_runs_on_one_gpu():
    """examples/world_one.py with plain python: both cases print ok."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "examples/world_one.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    assert r.stdout.splitlines() == ["tensor parallel 1: ok", "expert parallel, combined rows: ok"], r.stdout


# ---- the cluster layout (few tokens) --------------------------------------------------------------

def _check_in_a_graph(ws, call, out, label):
    """The call captured in a CUDA graph, its outputs poisoned, replayed, every element checked."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatch.moe_finalize_allreduce(ws, **call["kwargs"])
    for v in call["provided"][0].values():
        v.view(torch.uint8).fill_(ref.POISON_BYTE)
    graph.replay()
    torch.cuda.synchronize()
    _check(call, out, f"{label} in a graph")


def _same_bytes(a, b, *where):
    """Two calls' given outputs ({name: tensor}): the same names, every byte the same."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (*where, k)


@pytest.mark.parametrize("quant", QUANTS)
def test_cluster_layout_gives_the_one_block_layouts_bits(quant, seed_for):
    """Up to its token limit (cluster_max_tokens; for rows under cluster_round_min_warps warps
    cluster_small_row_many_routes_max_tokens at top_k 8, else cluster_small_row_max_tokens) the
    latency program spreads each row over a cluster of blocks, one vector a thread (dispatch picks
    its second kernel), each limit tested at its top_k here; every output must be the one-block
    layout's bits, two vectors a thread (the same loads and additions, the sum of squares in one order
    whatever the split), with and without PDL, eagerly and replayed in a CUDA graph.
    The one-block layout: a workspace whose launcher is made while the manifest's token limits
    read 0 (launchers are made at a workspace's first call of a program)."""
    from dispatch import launcher, registry
    from dispatch.workspace_sizes import cluster_row_split, row_split
    limits = registry.program_set().limits
    rnd = random.Random(seed_for("plan"))
    for H in (7168, 6144, 5120, 4096, 2048):  # clusters of 8, 8, 5, 8 and 4 blocks
        split = cluster_row_split(row_split(H // 8, limits["few_tokens_vec_per_thread"], limits["few_tokens_max"]),
                                  H // 8, limits["cluster_round_min_warps"], limits["cluster_max_blocks"],
                                  limits["max_threads"])
        blocks = launcher.cluster_blocks_for("local", (split,))
        most, few_routes = (launcher.cluster_max_tokens_for((split,), blocks, k) for k in (8, 2))
        assert (most, few_routes) == ((limits["cluster_max_tokens"],) * 2 if H >= 6144 else (
            limits["cluster_small_row_many_routes_max_tokens"], limits["cluster_small_row_max_tokens"])), H
        cluster_ws = dispatch.LocalWorkspace(max_tokens=most, hidden=H, dtype=torch.bfloat16)
        # a split the workspace fixes is the cluster layout's too: two vectors a thread over its blocks
        fixed_ws = dispatch.LocalWorkspace(max_tokens=most, hidden=H, dtype=torch.bfloat16, vec_per_thread=2)
        one_block_ws = dispatch.LocalWorkspace(max_tokens=limits["few_tokens_max"], hidden=H, dtype=torch.bfloat16)
        try:
            # each limit at its top_k: the most tokens at top_k 8, fewer routes' limit at top_k 1, 2 or 6
            for i, (T, top_k) in enumerate(((1, rnd.choice([1, 6, 8])), (5, rnd.choice([1, 6, 8])), (most, 8),
                                            (few_routes, rnd.choice([1, 2, 6])))):
                case = _case(T, H, torch.bfloat16, seed_for(f"case{H}-{T}-{top_k}"), rnd, top_k=top_k)
                got = {}
                for name, ws in (("cluster", cluster_ws), ("fixed split", fixed_ws), ("one block", one_block_ws)):
                    with pytest.MonkeyPatch.context() as patch:
                        if name == "one block":  # its launcher, made at its first call, sees no cluster layout
                            patch.setitem(limits, "cluster_max_tokens", 0)
                            patch.setitem(limits, "cluster_small_row_max_tokens", 0)
                            patch.setitem(limits, "cluster_small_row_many_routes_max_tokens", 0)
                        call, out = _run_and_check(ws, case, quant, f"{name} H={H} T={T}", pdl=i % 2 == 1)
                    # the outputs given (the call returns None for some profiles when they are given)
                    got[name] = {k: v.clone() for k, v in call["provided"][0].items()}
                    if name == "cluster":  # and replayed in a graph: the cluster launch captures
                        _check_in_a_graph(ws, call, out, f"cluster H={H} T={T}")
                _same_bytes(got["cluster"], got["one block"], quant, H, T)
                _same_bytes(got["fixed split"], got["one block"], quant, H, T, "fixed split")
            splits = {name: [la.cluster_split.vec_per_thread for la in ws._moe_ar_state.launchers.values()
                             if la.cluster_max_tokens > 0]
                      for name, ws in (("cluster", cluster_ws), ("fixed split", fixed_ws), ("one block", one_block_ws))}
            assert splits == {"cluster": [1], "fixed split": [2], "one block": []}, splits
            (la,) = [la for la in cluster_ws._moe_ar_state.launchers.values() if la.cluster_max_tokens > 0]
            assert la.uses_cluster(most, 8) and la.uses_cluster(few_routes, 2), H
            assert not la.uses_cluster(most + 1, 8) and not la.uses_cluster(few_routes + 1, 2), H
        finally:
            cluster_ws.close()
            fixed_ws.close()
            one_block_ws.close()


@pytest.mark.parametrize("quant", QUANTS)
def test_shape_builds_give_the_programs_bits(quant, seed_for, monkeypatch):
    """Up to shape_constants.MAX_TOKENS tokens the latency program runs a build with the call's shape
    as constants (dispatch/shape_constants.py), one per top_k and router weight kind: every output
    against the reference, and the bits of the program without constants (a launcher made while
    MOE_AR_SHAPE_CONSTANTS=0), at H 7168 (the cluster layout included), 4096, 2064 (vectors past the
    row) and 2048 (up to 128 tokens bound to one block a multiprocessor), with and without PDL, eagerly
    and replayed in a CUDA graph; above, both run the program."""
    rnd = random.Random(seed_for("plan"))
    profile = {q: name for name, q in PROFILE_QUANT.items()}[quant]
    for H in (7168, 4096, 2064, 2048):
        if quant == "fp8_group128" and H % 128:
            continue
        top = shape_constants.MAX_TOKENS + 8
        plain_ws = dispatch.LocalWorkspace(max_tokens=top, hidden=H, dtype=torch.bfloat16)
        built_ws = dispatch.LocalWorkspace(max_tokens=top, hidden=H, dtype=torch.bfloat16)
        try:
            for i, T in enumerate((1, 5, 48, 96, 300, shape_constants.MAX_TOKENS, top)):
                case = _case(T, H, torch.bfloat16, seed_for(f"case{H}-{T}"), rnd)
                got = {}
                for name, ws in (("plain", plain_ws), ("shape build", built_ws)):
                    if name == "plain":
                        monkeypatch.setenv(shape_constants.ENV, "0")
                    call, out = _run_and_check(ws, case, quant, f"{name} H={H} T={T}", pdl=i % 2 == 1,
                                               program=f"moe_ar_local_bf16_ws1_{profile}")
                    monkeypatch.delenv(shape_constants.ENV, raising=False)
                    got[name] = {k: v.clone() for k, v in call["provided"][0].items()}
                    if name == "shape build" and T == 5:  # and replayed in a graph
                        _check_in_a_graph(ws, call, out, f"shape build H={H} T={T}")
                _same_bytes(got["plain"], got["shape build"], quant, H, T)
            assert any(la.shape_builds for la in built_ws._moe_ar_state.launchers.values()), "no shape build ran"
            assert not any(la.shape_builds for la in plain_ws._moe_ar_state.launchers.values())
            # the one-block builds: bound (min_blocks 1, key[2]) at H 2048 up to 128 tokens only
            keys = [key for la in built_ws._moe_ar_state.launchers.values() for key in (la.shape_builds or {})
                    if "cluster" not in key]
            assert sorted({key[2] for key in keys}, key=str) == ([1, None] if H == 2048 else [None]), (H, keys)
        finally:
            plain_ws.close()
            built_ws.close()


@pytest.mark.parametrize("quant", QUANTS)
def test_streaming_builds_give_the_programs_bits(quant, seed_for, monkeypatch):
    """The streaming program runs a build with the call's shape as constants at top_k 8, up to its
    profile's STREAMING_MAX_HIDDEN (dispatch/shape_constants.py): every output against the reference, and the
    bits of the program without constants (a launcher made while MOE_AR_SHAPE_CONSTANTS=0), at H 7168,
    4096 and 2064 (vectors past the row), from one token to past a wave of blocks, with and without
    PDL, eagerly and replayed in a CUDA graph. At top_k 2 it runs the few-routes build (2 vectors a
    thread under its own register cap) up to FEW_ROUTES_MAX_HIDDEN, in FEW_ROUTES_PROFILES: the bits of
    the program without constants on a workspace that fixes that split; else the program. FP8
    group-128 runs the program above its STREAMING_MAX_HIDDEN (H 7168)."""
    rnd = random.Random(seed_for("plan"))
    profile = {q: name for name, q in PROFILE_QUANT.items()}[quant]
    for H in (7168, 4096, 2064):
        builds = H <= shape_constants.STREAMING_MAX_HIDDEN[profile]
        few = builds and shape_constants.few_routes("local_streaming", profile, H)
        if quant == "fp8_group128" and H % 128:
            continue
        top = 700
        plain_ws = dispatch.LocalWorkspace(max_tokens=top, hidden=H, dtype=torch.bfloat16)
        built_ws = dispatch.LocalWorkspace(max_tokens=top, hidden=H, dtype=torch.bfloat16)
        # the program without constants on the few-routes builds' split
        few_ws = dispatch.LocalWorkspace(max_tokens=top, hidden=H, dtype=torch.bfloat16,
                                         vec_per_thread=shape_constants.FEW_ROUTES_VEC_PER_THREAD)
        try:
            for i, (T, top_k) in enumerate(((1, 8), (37, 8), (300, 8), (top, 8), (300, 2), (top, 1))):
                case = _case(T, H, torch.bfloat16, seed_for(f"case{H}-{T}-{top_k}"), rnd, top_k=top_k)
                got = {}
                for name, ws in (("plain", few_ws if few and top_k <= 2 else plain_ws), ("shape build", built_ws)):
                    if name == "plain":
                        monkeypatch.setenv(shape_constants.ENV, "0")
                    call, out = _run_and_check(ws, case, quant, f"{name} H={H} T={T} top_k={top_k}",
                                               pdl=i % 2 == 1, program=f"moe_ar_local_streaming_bf16_ws1_{profile}")
                    monkeypatch.delenv(shape_constants.ENV, raising=False)
                    got[name] = {k: v.clone() for k, v in call["provided"][0].items()}
                    if name == "shape build" and T == 37:  # and replayed in a graph
                        _check_in_a_graph(ws, call, out, f"streaming build H={H} T={T}")
                _same_bytes(got["plain"], got["shape build"], quant, H, T, top_k)
            launchers = [la for la in built_ws._moe_ar_state.launchers.values() if la.regime == "local_streaming"]
            assert any(la.shape_builds for la in launchers) == builds, "a build ran" if not builds else "no build ran"
            # a build's key: (top_k, scale kind, one-block bound); the streaming program's are never bound,
            # and of top_k 8, or of the few routes where they apply
            keys = {key for la in launchers for key in (la.shape_builds or {})}
            allowed = {(k, s, None) for k in ((8, 2, 1) if few else (8,)) for s in shape_constants.SCALE_KINDS}
            assert keys <= allowed, ("an unexpected build", sorted(keys))
            assert few == any(key[0] <= 2 for key in keys), ("few-routes builds", few, sorted(keys))
            assert not any(la.shape_builds for la in plain_ws._moe_ar_state.launchers.values())
            assert not any(la.shape_builds for la in few_ws._moe_ar_state.launchers.values())
        finally:
            plain_ws.close()
            built_ws.close()
            few_ws.close()


# ---- a token's bits whatever the batch -------------------------------------------------------------

_PER_TOKEN = ("expanded_idx_to_permuted_idx", "residual_in", "shared_expert_output", "expert_scale_factor")


@pytest.mark.parametrize("quant", QUANTS)
def test_a_tokens_outputs_are_the_same_bits_whatever_the_batch(quant, workspaces, seed_for):
    """The first tokens of a 300-token call, called again alone in batches of 1 to 160 tokens. A
    program forced: the same bits in every output, whichever of its paths each batch runs (the
    latency program's cluster layout of one vector a thread and its one-block layout of two, whose
    sums of squares take one order; every load of a row at once, four routes at a time with the
    indices read first, on a grid that strides over the tokens or not). The automatic choice, which
    moves from the latency to the streaming program (another order of the sum of squares):
    residual_out the same bits (docs/operation.md, "A token's bits and the batch"). NVFP4's swizzled scales are not sliced per token; its quant_out
    bytes are compared."""
    rnd = random.Random(seed_for("plan"))
    T = 300
    for H in (7168, 4096):
        ws = workspaces.get(MAX_TOKENS, H, torch.bfloat16)
        case = _case(T, H, torch.bfloat16, seed_for(f"case{H}"), rnd, top_k=8, shared=True, drop_frac=0.15)
        profile = {q: name for name, q in PROFILE_QUANT.items()}[quant]
        programs = [None] + [p for p in PROGRAMS if p.endswith(f"_bf16_ws1_{profile}")]
        assert len(programs) == 3, programs
        for program in programs:
            call, _ = _run_and_check(ws, case, quant, f"{program} H={H} T={T}", program=program)
            whole = call["provided"][0]
            for n in (1, 5, 16, 17, 40, 133, 160):
                kwargs = {k: v for k, v in call["kwargs"].items()
                          if k not in ("norm_out", "residual_out", "quant_out", "scale_out")}
                for k in _PER_TOKEN:
                    if kwargs.get(k) is not None:
                        kwargs[k] = kwargs[k][:n].contiguous()
                got = dispatch.moe_finalize_allreduce(ws, **kwargs)
                torch.cuda.synchronize()
                pairs = [("residual_out", got.residual_out)]
                one_order = program is not None
                if one_order:
                    pairs.append(("norm_out", got.norm_out))
                if quant is not None and one_order:
                    pairs.append(("quant_out", got.quant_out))
                if quant == "fp8_group128" and one_order:  # row-major scales
                    pairs.append(("scale_out", got.scale_out))
                for name, out in pairs:
                    want = whole[name].reshape(-1)[:out.numel()] if name == "scale_out" else whole[name][:n]
                    assert torch.equal(out.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
                        (quant, program, H, n, name)
