"""Reliability (issue #5): faults, hostile input and lifetimes, on the GPU.

Faults, each followed by the documented recovery (`reset()`) and fresh calls checked in full against
the float64 reference (moe_ar_tools/reference/), in the same process:

* a late rank: one rank's stream sleeps ~100 ms (torch.cuda._sleep, measured with CUDA events) before
  its kernel; with a 10 s deadline every rank is correct; with a 20 ms deadline every rank either
  raises "timed out in phase" or is correct (never silently wrong), and at least one raises.
  World size 2 and 4 on one GPU, 2 over GPUs 0 and 1; one-shot and two-shot.
* a rank that stops mid-exchange (the test hook fault_stop_after_units of dispatch/workspace_state.py:
  its kernels send their first n phase-1 work units and return): every other rank raises within a few
  deadlines of wall time, the faulty one does not; after reset three fresh calls (a full rotation of
  the three buffers) are correct. n = 1 and half the units; one-shot and two-shot; world sizes 2 and 4.
  (The one-rank-never-launches fault is tests/test_gpu_faults.py's.)

Hostile input: hypothesis draws invalid calls (dtype, shape, device, contiguity, alignment, not a
tensor, T > max_tokens, top_k, rows, quant, global_scale, weight_bias, eps, routed_scaling_factor,
scale_out size, unknown arguments, wrong programs) on a live world, through moe_finalize_allreduce
and through world.run: each raises ValueError whose message starts with the argument's name, and
valid calls afterwards are correct.

Lifetimes: two emulated worlds alive at once with interleaved calls; 1,000 create/close cycles with
no device-memory leak; in two processes, two workspaces on two process groups with interleaved calls,
then 1,000 Workspace create/close cycles over CUDA IPC with no device-memory, IPC-mapping or file
descriptor leak (MOE_AR_LIFETIME_CYCLES / MOE_AR_IPC_CYCLES scale the cycles down; default 1,000).
Constructors that fail: an EmulatedWorld whose rank 1 cannot allocate (pinned memory refused, or the
GPU out of memory) frees every rank and names rank 1; two processes on one GPU are refused by the
Workspace rendezvous on both (tests/test_gpu_two_process.py has the two-GPU rendezvous cases).

Every test appends a JSON line through `record_result` (kind "reliability"): what it did, calls,
faults injected, outcome, seconds; moe_ar_tools/reliability_summary.py turns them into the summary.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import pathlib
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import multiproc
from gpu_worlds import recording
from moe_ar_tools import reference as ref

pytestmark = pytest.mark.gpu

dispatch = pytest.importorskip("dispatch")

H = 2048
D = torch.bfloat16
MIB = 1 << 20
ENV = multiproc.ENV
FAULT_ONESHOT_CAP = 64  # T = 8 runs one-shot, T = 300 a two-shot (the early one at world sizes 2 and 4)


def _pipelined_tokens():
    """The smallest T this machine's tables give the pipelined two-shot, the ladder's last rung (world
    size 2, bf16, plain, hidden H, GPU 0); None where they never do (or there is no GPU)."""
    if not torch.cuda.is_available():
        return None
    from dispatch import table_sets
    selection = table_sets.for_workspace("bf16", 2, H, D.itemsize, 0)
    last = selection.limits("plain")[selection.fields[-1]]
    return None if last >= dispatch.registry.program_set().all_tokens else last + 1


PIPELINED_T = _pipelined_tokens()
FAULT_MAX_TOKENS = max(512, PIPELINED_T or 0)
LIFETIME_CYCLES = int(os.environ.get("MOE_AR_LIFETIME_CYCLES", "1000"))
IPC_CYCLES = int(os.environ.get("MOE_AR_IPC_CYCLES", "1000"))
IPC_GUARD_S = float(os.environ.get("MOE_AR_IPC_GUARD_S", "120"))  # stop the IPC cycles early past this (recorded)


# ---- helpers ---------------------------------------------------------------------------------------

# The fields every record of this module starts with (gpu_worlds.recording): the summary's counts.
RELIABILITY = dict(kind="reliability", calls=0, faults_injected=0)


def _devs(world):
    return [torch.device("cuda", d) for d in world.devices]


def _sync(world):
    for d in sorted(set(world.devices)):
        torch.cuda.synchronize(d)


def _call(world, T, seed, *, quant=None, K=4, pdl=False, shared=True):
    """Inputs, poisoned preallocated outputs and every rank's kwargs for one call (nothing launched)."""
    case = ref.make_case(world.world_size, T, world.hidden, K, world.dtype, seed=seed, device=_devs(world),
                         scale_kind="fp32", shared=shared)
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16)
    kwargs = []
    for kw, p in zip(case, provided):
        d = dict(kw)
        d.update(p)
        d.update(quant=quant, launch_with_pdl=pdl)
        if quant == "nvfp4":
            d["global_scale"] = torch.tensor([1.0], dtype=torch.float32, device=kw["residual_in"].device)
        kwargs.append(d)
    return dict(case=case, provided=provided, kwargs=kwargs, quant=quant, gs=1.0 if quant else None)


def _check_call(call, outs, ranks=None, label=""):
    ranks = range(len(call["case"])) if ranks is None else ranks
    ref.check_outputs(call["case"], {r: outs[r] for r in ranks}, {r: call["provided"][r] for r in ranks},
                      quant=call["quant"], global_scale=call["gs"], label=label)


def _run_checked(world, T, seed, label, **kw):
    """One call on every rank, synchronized, no timeout, every rank checked in full."""
    call = _call(world, T, seed, **kw)
    outs = world.run(call["kwargs"])
    _sync(world)
    world.check()
    _check_call(call, outs, label=label)
    return call


def _program(world, rank, T, shared=True, quant=None):
    return dispatch.select_program(world.workspaces[rank], T, quant, shared)


def _phase1_units(ws, name, T):
    """Phase-1 work units of program `name` at T tokens on this rank, as the launcher counts them."""
    launcher = ws._moe_ar_state.launchers.get(name)
    if launcher is not None and hasattr(launcher, "sliced_units"):
        sliced = bool(launcher.sliced_units)
    else:
        info = dispatch.program_info(name)
        sliced = info.get("sliced_units", info["family"] not in ("twoshot", "twoshot_shared"))
    return T * ws.row_splits[ws.row_split_index(T)].vec_per_thread if sliced else T


def _sleep_cycles(device_index, seconds):
    """torch.cuda._sleep cycles lasting at least `seconds` at the GPU's highest clock (clock_rate when torch
    reports it, else 1.98 GHz, an H200's boost clock); a slower clock only makes the delay longer."""
    props = torch.cuda.get_device_properties(device_index)
    khz = getattr(props, "clock_rate", 0) or 0
    return int(max(1.98e9, khz * 1e3) * seconds)


def _free_device_memory(device=None):
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _proc_count(what):
    try:
        if what == "maps":
            with open("/proc/self/maps") as f:
                return sum(1 for _ in f)
        if what == "fds":
            return len(os.listdir("/proc/self/fd"))
        if what == "rss":
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextlib.contextmanager
def _no_gc():
    """Keep a garbage-collection pause out of the launch loop of a world with a 20 ms deadline."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---- faults: a late rank ---------------------------------------------------------------------------------

WORLDS = [pytest.param(2, None, id="ws2-1gpu"), pytest.param(4, None, id="ws4-1gpu"),
          pytest.param(2, [0, 1], id="ws2-2gpus")]
REGIME_T = {"oneshot": 8, "twoshot": 300, "pipelined": PIPELINED_T}


def _timed_out_ranks(world) -> dict:
    """{rank: message} for every rank whose check() raised the timeout error; any other error fails."""
    out = {}
    for r, w in enumerate(world.workspaces):
        try:
            w.check()
        except RuntimeError as e:
            assert "timed out in phase" in str(e), str(e)
            out[r] = str(e)
    return out


def _regime_case(world, regime, rank):
    """T for the regime (skips where this world has no such regime) and the program it runs."""
    if regime == "pipelined" and (world.world_size != 2 or PIPELINED_T is None):
        pytest.skip("the pipelined two-shot runs at world size 2 only, where the tables select it")
    T = REGIME_T[regime]
    name = _program(world, rank, T)
    if regime == "pipelined":
        assert dispatch.program_info(name)["family"] == "twoshot_pipelined", name
    return T, name


@pytest.mark.parametrize("timeout_s", [10.0, 0.02], ids=["deadline10s", "deadline20ms"])
@pytest.mark.parametrize("regime", ["oneshot", "twoshot", "pipelined"])
@pytest.mark.parametrize("ws,devices", WORLDS)
def test_late_rank(ws, devices, regime, timeout_s, seed_for, record_result):
    if devices is not None and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    other_T = REGIME_T["twoshot" if regime == "oneshot" else "oneshot"]
    late = ws - 1
    world = dispatch.EmulatedWorld(ws, FAULT_MAX_TOKENS, H, D, devices=devices, timeout_s=timeout_s,
                                   oneshot_max_tokens=FAULT_ONESHOT_CAP)
    try:
        T, name = _regime_case(world, regime, late)
        with recording(record_result, **RELIABILITY,
                       what="late rank (~100 ms)", world_size=ws, devices=devices or "one_gpu",
                       tokens=T, regime=regime, timeout_s=timeout_s, late_rank=late, program=name) as info:
            with _no_gc():
                _run_checked(world, T, seed_for("warm"), "before the fault")  # compiles and loads the programs
            info["calls"] += 1
            call = _call(world, T, seed_for("late"))
            dev = world.devices[late]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(world.streams[late]):  # run() makes this stream wait, then launches on it
                e0.record()
                torch.cuda._sleep(_sleep_cycles(dev, 0.11))
                e1.record()
            t0 = time.perf_counter()
            with _no_gc():
                outs = world.run(call["kwargs"])
            _sync(world)
            info["wall_s"] = round(time.perf_counter() - t0, 3)
            info["calls"] += 1
            info["faults_injected"] += 1
            info["delay_ms"] = round(e0.elapsed_time(e1), 1)
            assert info["delay_ms"] >= 80.0, f"the late rank was only {info['delay_ms']} ms late"
            raised = sorted(_timed_out_ranks(world))
            correct = [r for r in range(ws) if r not in raised]
            for r in correct:
                _check_call(call, outs, [r], label=f"late rank: rank {r} did not raise, so it must be correct")
            info.update(raised_ranks=raised, correct_ranks=correct)
            if timeout_s >= 1.0:
                assert correct == list(range(ws)), f"a 10 s deadline must absorb a 100 ms delay: raised {raised}"
            else:
                assert raised, "a 100 ms delay under a 20 ms deadline: some rank must have timed out"
            world.reset()
            with _no_gc():
                _run_checked(world, T, seed_for("after1"), "after reset")
                _run_checked(world, other_T, seed_for("after2"), "after reset, other regime")
            info["calls"] += 2
            info["outcome"] = (f"{len(raised)} rank(s) raised 'timed out', {len(correct)} correct, none wrong; "
                               f"reset, 2 fresh calls correct")
    finally:
        world.close()


# ---- faults: a rank stops mid-exchange --------------------------------------------------------------------

@pytest.mark.parametrize("how", ["one_unit", "half_the_units"])
@pytest.mark.parametrize("regime", ["oneshot", "twoshot", "pipelined"])
@pytest.mark.parametrize("ws", [2, 4])
def test_rank_stops_mid_exchange(ws, regime, how, seed_for, record_result):
    other_T = REGIME_T["twoshot" if regime == "oneshot" else "oneshot"]
    timeout_s = 0.2
    world = dispatch.EmulatedWorld(ws, FAULT_MAX_TOKENS, H, D, timeout_s=timeout_s,
                                   oneshot_max_tokens=FAULT_ONESHOT_CAP)
    try:
        faulty = random.Random(seed_for("rank")).randrange(ws)
        wsf = world.workspaces[faulty]
        T, name = _regime_case(world, regime, faulty)
        with recording(record_result, **RELIABILITY,
                       what="rank stops mid-exchange", world_size=ws, devices="one_gpu", tokens=T,
                       regime=regime, timeout_s=timeout_s, faulty_rank=faulty, program=name) as info:
            _run_checked(world, T, seed_for("warm"), "before the fault")
            info["calls"] += 1
            units = _phase1_units(wsf, name, T)
            n = 1 if how == "one_unit" else max(1, units // 2)
            assert n < units
            info.update(phase1_units=units, stop_after_units=n)
            call = _call(world, T, seed_for("fault"))
            wsf._moe_ar_state.fault_stop_after_units = n  # drops its plans: the next call's plan carries it
            t0 = time.perf_counter()
            try:
                world.run(call["kwargs"])
                _sync(world)
            finally:
                wsf._moe_ar_state.fault_stop_after_units = 0
            wall = time.perf_counter() - t0
            info.update(wall_s=round(wall, 3))
            info["calls"] += 1
            info["faults_injected"] += 1
            timed_out = _timed_out_ranks(world)
            raised, messages = sorted(timed_out), [timed_out[r][:160] for r in sorted(timed_out)]
            info.update(raised_ranks=raised, messages=messages)
            assert faulty not in raised, f"the faulty rank {faulty} itself raised: {messages}"
            assert raised == [r for r in range(ws) if r != faulty], \
                f"every other rank must time out, raised {raised} (faulty {faulty})"
            assert wall < 5.0, f"the others took {wall:.2f} s to give up on a {timeout_s} s deadline"
            world.reset()
            for j, t in enumerate((T, other_T, T)):  # a full rotation of the three buffers, and back
                _run_checked(world, t, seed_for(f"after{j}"), f"after reset, call {j} (T={t})")
            info["calls"] += 3
            info["outcome"] = (f"ranks {raised} raised 'timed out' in {wall:.2f} s wall, faulty rank {faulty} did not; "
                               f"reset, 3 fresh calls correct")
    finally:
        world.close()


# ---- hostile input on a live world --------------------------------------------------------------------------

HOSTILE_T, HOSTILE_K, HOSTILE_MAX_T, HOSTILE_OCAP = 5, 3, 64, 8
TENSOR_ARGS = ("allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
               "residual_in", "norm_weight", "global_scale", "norm_out", "residual_out", "quant_out", "scale_out")
MUTATIONS = ("dtype", "shape", "cpu", "other_gpu", "non_contiguous", "misaligned", "not_a_tensor")


def _mutate(x: torch.Tensor, how: str):
    """A version of x that breaks one rule of the API, or None where that rule cannot be broken this way."""
    if how == "dtype":
        return x.to({torch.int32: torch.int64, torch.uint8: torch.int8}.get(x.dtype, torch.float64))
    if how == "shape":
        if x.dtype == torch.int32:  # the routing defines T and K: a wrong one is one that is not 2-D
            return x.flatten()
        if x.dim() == 1 and x.dtype == torch.uint8:  # scale_out may be longer than needed, not 2-D
            return x.view(1, -1)
        return torch.cat([x, x[..., :1]], dim=-1)  # one column (or element) too many
    if how == "cpu":
        return x.cpu()
    if how == "other_gpu":
        if torch.cuda.device_count() < 2:
            return None
        return x.to(torch.device("cuda", 1 - x.device.index if x.device.index in (0, 1) else 0))
    if how == "non_contiguous":
        if x.dim() == 2 and x.shape[1] > 1:
            return torch.cat([x, x], dim=1)[:, ::2]
        if x.dim() == 1 and x.numel() > 1:
            return torch.stack([x, x], dim=-1)[..., 0]
        return None
    if how == "misaligned":
        if x.element_size() >= 4:  # int32/float32 views cannot start inside an element
            return None
        buf = torch.empty(x.numel() + 64, dtype=x.dtype, device=x.device)
        v = buf[1:1 + x.numel()].view(x.shape)
        v.copy_(x)
        return v
    if how == "not_a_tensor":
        return x.tolist()
    raise AssertionError(how)


def _valid_kwargs(world, seed, T=HOSTILE_T, K=HOSTILE_K):
    """Every rank's valid call with every optional argument given (NVFP4, scales, shared, outputs)."""
    case = ref.make_case(world.world_size, T, world.hidden, K, world.dtype, seed=seed, device=_devs(world),
                         scale_kind="fp32", shared=True, padded_rows=2)
    out = []
    for kw in case:
        dev = kw["residual_in"].device
        d = dict(kw, quant="nvfp4", global_scale=torch.tensor([1.0], dtype=torch.float32, device=dev),
                 norm_out=torch.empty(T, world.hidden, dtype=world.dtype, device=dev),
                 residual_out=torch.empty(T, world.hidden, dtype=world.dtype, device=dev),
                 quant_out=torch.empty(T, world.hidden // 2, dtype=torch.uint8, device=dev),
                 scale_out=torch.empty(dispatch.scale_out_bytes(T, world.hidden) + 16, dtype=torch.uint8, device=dev))
        out.append(d)
    return out


def _other_program(world, *, world_size=None, dtype=None):
    W = world.world_size
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[world.dtype]
    for name in dispatch.programs():
        info = dispatch.program_info(name)
        if world_size and info["world_size"] != W and info["dtype"] == dname:
            return name
        if dtype and info["dtype"] != dname and info["world_size"] == W:
            return name
    raise AssertionError("no such program")


def _value_cases():
    """(label, fn(kw, world, draw) -> the argument name the error must start with)."""
    def setk(k, v):
        def f(kw, world, draw):
            kw[k] = v(kw, world, draw) if callable(v) else v
            return k
        return f

    def idx_of(shape):
        return lambda kw, world, draw: torch.zeros(shape(world), dtype=torch.int32, device=kw["residual_in"].device)

    def unknown(kw, world, draw):
        name = draw(st.sampled_from(["residual", "norm_weights", "top_k", "stream", "expert_scales",
                                     "globalscale", "out", "workspace_ptrs"]))
        kw[name] = kw["residual_in"]
        return name

    def oneshot_over_capacity(kw, world, draw):
        T = HOSTILE_OCAP + 1  # more tokens than the workspace's one-shot buffer holds
        kw.clear()
        kw.update(_valid_kwargs(world, seed=draw(st.integers(0, 2 ** 30)), T=T)[0])  # one device: any rank's
        kw["program"] = dispatch.select_program(world.workspaces[0], 1, "nvfp4", True)  # the one-shot program
        return "program"

    return [
        ("T > max_tokens", lambda kw, world, draw: setk("expanded_idx_to_permuted_idx", idx_of(
            lambda w: (w.max_tokens + 1, HOSTILE_K)))(kw, world, draw)),
        ("top_k 0", setk("expanded_idx_to_permuted_idx", idx_of(lambda w: (HOSTILE_T, 0)))),
        ("top_k 17", setk("expanded_idx_to_permuted_idx", idx_of(lambda w: (HOSTILE_T, 17)))),
        ("too few rows", setk("allreduce_in", lambda kw, w, d: kw["allreduce_in"][: HOSTILE_T * HOSTILE_K - 1])),
        ("rows of another hidden", setk("allreduce_in", lambda kw, w, d: torch.randn(
            HOSTILE_T * HOSTILE_K + 2, w.hidden + 16, device=kw["residual_in"].device).to(w.dtype))),
        ("quant unknown", setk("quant", lambda kw, w, d: d(st.sampled_from(["fp4", "NVFP4", "int4", "", 1])))),
        ("nvfp4 without global_scale", setk("global_scale", None)),
        ("weight_bias", setk("weight_bias", lambda kw, w, d: d(st.sampled_from([2, -1, 0.5, "1"])))),
        ("eps", setk("eps", lambda kw, w, d: d(st.sampled_from(["1e-6", None, [1e-6]])))),
        ("routed_scaling_factor", setk("routed_scaling_factor", lambda kw, w, d: d(st.sampled_from(
            [None, "2", torch.tensor(1.0)])))),
        ("scale_out too small", setk("scale_out", lambda kw, w, d: kw["scale_out"][: dispatch.scale_out_bytes(
            HOSTILE_T, w.hidden) - 1])),
        ("norm_weight 2-D", setk("norm_weight", lambda kw, w, d: kw["norm_weight"].view(1, -1))),
        ("unknown argument", unknown),
        ("program unknown", setk("program", "moe_ar_zz_bf16_ws2_plain")),
        ("program of another world size", setk("program", lambda kw, w, d: _other_program(w, world_size=True))),
        ("program of another dtype", setk("program", lambda kw, w, d: _other_program(w, dtype=True))),
        ("program of another profile", setk("program", lambda kw, w, d: dispatch.select_program(
            w.workspaces[0], HOSTILE_T, None, True))),
        ("one-shot program past its capacity", oneshot_over_capacity),
    ]


VALUE_CASES = _value_cases()


@pytest.fixture(scope="module")
def hostile_world():
    w = dispatch.EmulatedWorld(2, HOSTILE_MAX_T, H, D, timeout_s=2.0, oneshot_max_tokens=HOSTILE_OCAP)
    yield w
    w.close()


def test_hostile_calls_are_named_and_leave_the_world_healthy(hostile_world, seed_for, record_result):
    world = hostile_world
    W = world.world_size
    hits = collections.Counter()

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @hypothesis_seed(seed_for("hypothesis"))
    @given(data=st.data())
    def one(data):
        via = data.draw(st.sampled_from(["moe_finalize_allreduce", "world.run"]), label="via")
        rank = data.draw(st.integers(0, W - 1), label="rank")
        kws = _valid_kwargs(world, seed=data.draw(st.integers(0, 2 ** 30), label="seed"))
        kw = kws[rank]
        if data.draw(st.booleans(), label="bad tensor"):
            name = data.draw(st.sampled_from(TENSOR_ARGS), label="argument")
            how = data.draw(st.sampled_from(MUTATIONS), label="mutation")
            bad = _mutate(kw[name], how)
            assume(bad is not None)
            kw[name] = bad
            label = f"{name} {how}"
        else:
            label, fn = data.draw(st.sampled_from(VALUE_CASES), label="value")
            name = fn(kw, world, data.draw)
        if via == "world.run" and data.draw(st.integers(0, 9), label="count") == 0:
            kws = kws[:-1]  # one dict short
            name, label = "per_rank_kwargs", "per_rank_kwargs one short"
        with pytest.raises(ValueError) as e:
            if via == "world.run":
                world.run(kws)
            else:
                dispatch.moe_finalize_allreduce(world.workspaces[rank], **kw)
        assert str(e.value).startswith(name + ":"), (label, via, str(e.value))
        hits[f"{label} via {via}"] += 1

    with recording(record_result, **RELIABILITY, what="hostile input (hypothesis) then valid calls", world_size=W,
                   devices="one_gpu") as info:
        try:
            one()
        except BaseException:
            torch.cuda.synchronize()
            world.reset()
            raise
        info["hostile_calls"] = sum(hits.values())
        info["kinds"] = len(hits)
        info["hits"] = dict(hits)
        # nothing launched: valid calls on every rank are correct, no rank timed out
        for j, T in enumerate((HOSTILE_T, HOSTILE_OCAP + 3, 1)):
            _run_checked(world, T, seed_for(f"valid{j}"), f"valid call {j} after the hostile ones", quant="nvfp4")
        world.check()
        info["calls"] = 3
        info["outcome"] = f"{info['hostile_calls']} hostile calls each raised ValueError naming the argument; " \
                          f"3 valid calls correct after"
    assert info["hostile_calls"] >= 30, hits


def test_a_closed_world_is_named_workspace(seed_for, record_result):
    with recording(record_result, **RELIABILITY,
                   what="call on a closed workspace", world_size=2, devices="one_gpu") as info:
        world = dispatch.EmulatedWorld(2, 16, H, D, timeout_s=2.0)
        call = _call(world, 4, seed_for("c"))
        world.close()
        with pytest.raises(ValueError, match=r"^workspace:"):
            dispatch.moe_finalize_allreduce(world.workspaces[0], **call["kwargs"][0])
        with pytest.raises(ValueError, match=r"^workspace:"):
            world.run(call["kwargs"])
        info["hostile_calls"] = 2
        info["outcome"] = "ValueError('workspace: ...') both ways"


# ---- lifetimes -------------------------------------------------------------------------------------------------

def test_two_worlds_interleaved_do_not_interfere(seed_for, record_result):
    """Two worlds of different size, dtype and hidden alive at once; calls alternate A, B, A, B with no
    synchronization between them; every output of every call checked."""
    rnd = random.Random(seed_for("plan"))
    a = dispatch.EmulatedWorld(2, 256, 2048, torch.bfloat16, timeout_s=10.0)
    b = dispatch.EmulatedWorld(4, 384, 4096, torch.float16, timeout_s=10.0, oneshot_max_tokens=32)
    try:
        with recording(record_result, **RELIABILITY, what="two emulated worlds, interleaved calls", world_size="2+4",
                       devices="one_gpu") as info:
            pending = []
            programs = collections.Counter()
            for i in range(24):
                for tag, w in (("A", a), ("B", b)):
                    T = rnd.choice([1, rnd.randint(2, 32), rnd.randint(33, w.max_tokens)])
                    quant = rnd.choice([None, "nvfp4"])
                    call = _call(w, T, seed_for(f"{tag}{i}"), quant=quant, K=rnd.randint(1, 8),
                                 pdl=rnd.random() < 0.5)
                    call["outs"] = w.run(call["kwargs"])
                    pending.append((f"world {tag} call {i} T={T} quant={quant}", call))
                    programs[_program(w, 0, T, quant=quant)] += 1
                if i % 4 == 3:
                    _sync(a)
                    a.check()
                    b.check()
                    for label, call in pending:
                        _check_call(call, call["outs"], label=label)
                    info["calls"] += len(pending)
                    pending = []
            info["programs"] = dict(programs)
            info["outcome"] = f"{info['calls']} calls on two live worlds, all correct"
    finally:
        a.close()
        b.close()


def test_create_close_cycles_leak_no_device_memory(seed_for, record_result):
    rnd = random.Random(seed_for("plan"))
    live = dispatch.workspace._live_workspaces
    with recording(record_result, **RELIABILITY,
                   what="EmulatedWorld create/close cycles", world_size=2, devices="one_gpu",
                   cycles_requested=LIFETIME_CYCLES) as info:
        for j in range(3):  # warm-up: both programs the cycles use loaded, allocator and CuPy kernels ready
            w = dispatch.EmulatedWorld(2, 16, H, D, timeout_s=10.0)
            for quant in (None, "nvfp4"):
                _run_checked(w, 4, seed_for(f"warm{j}{quant}"), "warm-up", quant=quant)
            w.close()
        del w
        live0 = len(live)
        free0 = _free_device_memory()
        rss0 = _proc_count("rss")
        t0 = time.perf_counter()
        for c in range(LIFETIME_CYCLES):
            w = dispatch.EmulatedWorld(2, 16, H, D, timeout_s=10.0)
            if c % 100 == 0:
                _run_checked(w, rnd.randint(1, 16), seed_for(f"cycle{c}"), f"call in cycle {c}",
                             quant=rnd.choice([None, "nvfp4"]))
                info["calls"] += 1
            w.close()
        del w
        info["cycles_done"] = LIFETIME_CYCLES
        info["cycle_seconds"] = round(time.perf_counter() - t0, 2)
        free1 = _free_device_memory()
        rss1 = _proc_count("rss")
        info.update(free_before=free0, free_after=free1, device_memory_drift_bytes=free0 - free1,
                    live_workspaces_left=len(live) - live0,
                    rss_drift_bytes=(rss1 - rss0) if rss0 is not None and rss1 is not None else None)
        assert abs(free0 - free1) < 16 * MIB, f"device memory drifted by {(free0 - free1) / MIB:.1f} MiB"
        assert len(live) == live0, "closed workspaces are still registered as live"
        info["outcome"] = (f"{LIFETIME_CYCLES} cycles in {info['cycle_seconds']} s, device memory drift "
                           f"{(free0 - free1) / MIB:.2f} MiB, {info['calls']} calls correct")


# ---- lifetimes, two processes (two process groups; CUDA IPC create/close cycles) ------------------------------

def _spawn(fn_name, nprocs, args, timeout_s):
    multiproc.spawn("test_gpu_reliability", fn_name, nprocs, args, timeout_s)


_read_rows = multiproc.read_rank_rows


def test_two_groups_and_ipc_cycles_two_processes(tmp_path, base_seed, record_result):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.time()
    try:
        _spawn("_worker_lifetimes", 2, (str(tmp_path / "init"), str(out), base_seed, IPC_CYCLES, IPC_GUARD_S),
               timeout_s=420)
    finally:
        rows = _read_rows(out)
        for r in rows:
            record_result(**r, seconds=round(time.time() - t0, 2))
    assert len(rows) == 2 and all(r["passed"] for r in rows), rows


def _one_rank_call(dist, ws, rank, dev, rnd, T, label, failures):
    """This rank's call with inputs both processes draw from one seed on the CPU; its outputs checked in
    full, and compared bit for bit with the other process's."""
    quant = rnd.choice([None, "nvfp4"])
    K = rnd.randint(1, 8)
    pdl = rnd.random() < 0.5
    case = ref.make_case(2, T, ws.hidden, K, ws.dtype, seed=rnd.getrandbits(62), device=dev, gen_device="cpu",
                         scale_kind="fp32", shared=True)
    provided = ref.alloc_outputs(case, quant, extra_scale_bytes=16)[rank]
    kw = dict(case[rank])
    kw.update(provided, quant=quant, launch_with_pdl=pdl)
    if quant:
        kw["global_scale"] = torch.tensor([1.0], dtype=torch.float32, device=dev)
    out = import_dispatch().moe_finalize_allreduce(ws, **kw)
    return (label, case, out, provided, quant)


def import_dispatch():
    import dispatch as d
    return d


def _check_pending(dist, rank, pending, failures):
    for label, case, out, provided, quant in pending:
        try:
            ref.check_outputs(case, {rank: out}, {rank: provided}, quant=quant,
                              global_scale=1.0 if quant else None, label=label)
        except AssertionError as e:
            failures.append(str(e)[:1500])
        mine = [provided["residual_out"], provided["norm_out"]]
        if quant:
            mine += [provided["quant_out"], provided["scale_out"][: ref.scale_out_bytes(*provided["norm_out"].shape)]]
        for t in mine:
            b = t.contiguous().view(torch.uint8).reshape(-1)
            allb = [torch.empty_like(b) for _ in range(2)]
            dist.all_gather(allb, b)
            if not torch.equal(allb[0], allb[1]):
                failures.append(f"{label}: outputs differ between the processes in {int((allb[0] != allb[1]).sum())} "
                                f"bytes")


def _worker_lifetimes(rank, init_file, out_dir, base_seed, cycles, guard_s):
    os.environ.update(ENV)
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dispatch_ = import_dispatch()
    dev = torch.device("cuda", rank)
    row = dict(kind="reliability", what="two process groups in one process, then Workspace create/close cycles "
                                        "over CUDA IPC", rank=rank, world_size=2, devices="two_gpus",
               calls=0, faults_injected=0, cycles_requested=cycles, cycles_done=0)
    failures = []
    t_start = time.monotonic()
    try:
        ga = dist.new_group([0, 1])
        gb = dist.new_group([0, 1])
        wa = dispatch_.Workspace(ga, 256, 2048, torch.bfloat16, timeout_s=10.0)
        wb = dispatch_.Workspace(gb, 384, 4096, torch.float16, timeout_s=10.0, oneshot_max_tokens=32)
        rnd = random.Random(f"{base_seed}:two groups")  # the same plan in both processes
        for i in range(8):
            pending = []
            for tag, ws in (("A", wa), ("B", wb)):  # back to back on one stream, no sync between
                T = rnd.choice([1, rnd.randint(2, 32), rnd.randint(33, ws.max_tokens)])
                pending.append(_one_rank_call(dist, ws, rank, dev, rnd, T, f"group {tag} call {i} T={T}", failures))
            torch.cuda.synchronize()
            wa.check()
            wb.check()
            _check_pending(dist, rank, pending, failures)
            row["calls"] += len(pending)
        wa.close()
        wb.close()
        if wa._opened or wb._opened:
            failures.append("close() left IPC mappings open")

        # create/close cycles on one group
        for _ in range(5):  # warm-up: communicators, allocator, CuPy kernels
            w = dispatch_.Workspace(ga, 16, 2048, torch.bfloat16, timeout_s=10.0)
            w.close()
        free0 = _free_device_memory(dev)
        maps0, fds0, rss0 = _proc_count("maps"), _proc_count("fds"), _proc_count("rss")
        t0 = time.monotonic()
        done = 0
        stopped_early = False
        for c in range(cycles):
            w = dispatch_.Workspace(ga, 16, 2048, torch.bfloat16, timeout_s=10.0)
            if len(w._opened) != 1:
                failures.append(f"cycle {c}: {len(w._opened)} IPC mappings open, expected 1")
            if c % 100 == 0:
                pend = [_one_rank_call(dist, w, rank, dev, rnd, rnd.randint(1, 16), f"IPC cycle {c}", failures)]
                torch.cuda.synchronize()
                w.check()
                _check_pending(dist, rank, pend, failures)
                row["calls"] += 1
            w.close()
            if w._opened:
                failures.append(f"cycle {c}: close() left {len(w._opened)} IPC mappings open")
            done += 1
            if c % 50 == 49:  # both processes stop together if the cycles run far slower than expected
                flag = torch.tensor([1 if time.monotonic() - t0 > guard_s else 0], device=dev)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if int(flag.item()):
                    stopped_early = True
                    break
            if len(failures) > 20:
                break
        cycle_s = time.monotonic() - t0
        free1 = _free_device_memory(dev)
        maps1, fds1, rss1 = _proc_count("maps"), _proc_count("fds"), _proc_count("rss")
        row.update(cycles_done=done, stopped_early=stopped_early, cycle_seconds=round(cycle_s, 2),
                   ms_per_cycle=round(1e3 * cycle_s / max(done, 1), 2),
                   device_memory_drift_bytes=free0 - free1, maps_lines_before=maps0, maps_lines_after=maps1,
                   fds_before=fds0, fds_after=fds1,
                   rss_drift_bytes=(rss1 - rss0) if rss0 is not None and rss1 is not None else None,
                   ipc_mappings_open_after=len(w._opened))
        if abs(free0 - free1) >= 16 * MIB:
            failures.append(f"device memory drifted by {(free0 - free1) / MIB:.1f} MiB over {done} cycles")
        # a leak of one mapping or descriptor per cycle would show as about `done` more
        if maps0 is not None and maps1 - maps0 >= max(64, done // 4):
            failures.append(f"/proc/self/maps grew from {maps0} to {maps1} lines over {done} cycles")
        if fds0 is not None and fds1 - fds0 >= max(16, done // 10):
            failures.append(f"open file descriptors grew from {fds0} to {fds1} over {done} cycles")
        if done < min(cycles, 200):
            failures.append(f"only {done} of {cycles} cycles ran")
        row["outcome"] = (f"{row['calls']} calls correct; {done} IPC create/close cycles in {cycle_s:.1f} s, "
                          f"device memory drift {(free0 - free1) / MIB:.2f} MiB, maps {maps0}->{maps1}, "
                          f"fds {fds0}->{fds1}, IPC mappings open after: 0")
    except BaseException as e:
        failures.append(f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        row["passed"] = not failures
        row["failures"] = failures[:5]
        row["worker_seconds"] = round(time.monotonic() - t_start, 2)
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps([row], default=str))
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures[:10]))


# ---- constructors that fail: EmulatedWorld allocation, two processes on one GPU -----------------------------

def test_emulated_world_allocation_failure_frees_every_rank(monkeypatch, seed_for, record_result):
    """A rank's allocation failing (pinned memory refused, or the GPU out of memory after rank 0's buffers):
    RuntimeError naming the rank, every rank's memory freed, nothing registered, dispatch.check() works,
    and a world built afterwards computes correct results."""
    from cupy.cuda import runtime
    from dispatch.workspace_sizes import buffer_elems_for
    live = dispatch.workspace._live_workspaces
    with recording(record_result, **RELIABILITY,
                   what="EmulatedWorld constructor: rank 1's pinned allocation fails; rank 1 "
                        "runs out of device memory", world_size=2, devices="one_gpu") as info:
        dispatch.EmulatedWorld(2, 16, H, D, timeout_s=10.0).close()  # CuPy and the allocator ready
        live0 = len(live)
        for case in ("hostAlloc", "out_of_memory"):
            free0 = _free_device_memory()
            filler = None
            max_tokens, hidden = (16384, 8192) if case == "out_of_memory" else (16, H)
            if case == "hostAlloc":
                real, calls = runtime.hostAlloc, []

                def host_alloc(*a):
                    calls.append(1)
                    if len(calls) == 2:  # rank 1's
                        raise RuntimeError("hostAlloc failed (injected)")
                    return real(*a)
                monkeypatch.setattr(runtime, "hostAlloc", host_alloc)
            else:  # room for rank 0's buffers and 512 MiB, not for rank 1's
                rank_bytes = 3 * buffer_elems_for(2, max_tokens, hidden, 1024) * D.itemsize
                filler = torch.empty(max(free0 - rank_bytes - 512 * MIB, 0), dtype=torch.uint8, device="cuda")
            info["faults_injected"] += 1
            t0 = time.monotonic()
            try:
                with pytest.raises(RuntimeError, match="rank 1") as e:
                    dispatch.EmulatedWorld(2, max_tokens, hidden, D, timeout_s=10.0,
                                           oneshot_max_tokens=min(max_tokens, 1024))
            finally:
                monkeypatch.undo()
                del filler
            assert "freed" in str(e.value), str(e.value)
            assert ("memory" if case == "out_of_memory" else "injected") in str(e.value), str(e.value)
            assert time.monotonic() - t0 < 20.0
            free1 = _free_device_memory()
            assert abs(free0 - free1) < 16 * MIB, f"{case}: device memory {(free0 - free1) / MIB:.1f} MiB lower"
            assert len(live) == live0, f"{case}: a failed world's ranks are registered as live"
            dispatch.check()
        world = dispatch.EmulatedWorld(2, 64, H, D, timeout_s=10.0)
        try:
            _run_checked(world, 33, seed_for("after"), "after the failures")
            info["calls"] += 1
        finally:
            world.close()
        info["outcome"] = ("RuntimeError naming rank 1 both times, every rank's memory freed (drift < 16 MiB), "
                           "nothing registered; a world built afterwards correct")


def test_two_processes_on_one_gpu_are_refused(tmp_path, base_seed, record_result):
    """Two processes, one GPU (a gloo group: NCCL itself refuses two ranks on one GPU): both raise the
    device ValueError before allocating anything."""
    out = tmp_path / "out"
    out.mkdir()
    try:
        _spawn("_worker_same_gpu", 2, (str(tmp_path / "init"), str(out), base_seed), timeout_s=180)
    finally:
        rows = _read_rows(out)
        for r in rows:
            record_result(**r)
    assert len(rows) == 2 and all(r["passed"] for r in rows), rows
    assert rows[0]["message"] == rows[1]["message"], rows


def _worker_same_gpu(rank, init_file, out_dir, base_seed):
    os.environ.update(ENV)
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    dispatch_ = import_dispatch()
    live = dispatch_.workspace._live_workspaces
    row = dict(kind="reliability", what="Workspace: two processes on one GPU", rank=rank, world_size=2,
               devices="one_gpu", calls=0, faults_injected=0, hostile_calls=1)
    failures = []
    try:
        live0 = len(live)
        msg, fails, seconds = multiproc.expect_raise(
            lambda: dispatch_.Workspace(dist.group.WORLD, 64, 2048, torch.bfloat16, timeout_s=10.0), ValueError,
            "device: ranks 0 and 1 are on the same GPU", ("one process per GPU", "EmulatedWorld"), 30.0)
        failures += fails
        if len(live) != live0:
            failures.append("a refused workspace is registered as live")
        dispatch_.check()
        row.update(message=msg, seconds=round(seconds, 2),
                   outcome="the same ValueError('device: ranks 0 and 1 are on the same GPU ...') on both ranks")
    except BaseException as e:
        failures.append(f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        row["passed"] = not failures
        row["failures"] = failures[:5]
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps([row], default=str))
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: " + "\n".join(failures))
