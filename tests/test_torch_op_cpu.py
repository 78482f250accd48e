"""The torch custom op moe_ar::moe_finalize_allreduce and the FlashInfer-compatible entry.

CPU (CI): the workspace-handle registry; the fake (meta) implementation's shapes, dtypes, device
propagation and argument errors, under FakeTensorMode with fake CUDA tensors; the real
implementation's plumbing down to the launch (dispatch.op's argument checks, output allocation
and program selection run for real; only the kernel launch is replaced by a CPU computation of
the math for one rank), with torch.library.opcheck comparing it with the fake; torch.compile with
fullgraph=True (no graph break) through the eager and aot_eager backends on meta tensors; the
op's ordered side effect (an unused call is kept, two calls keep their order); one graph for
every rank's handle under dynamic=True; the FlashInfer entry's argument mapping and errors.

GPU (marker gpu, skipped without CUDA): a torch.compile'd function calling the op, captured in
one CUDA graph together with every rank's call of an EmulatedWorld of world size 2 (each rank
on its own stream, as EmulatedWorld.run does), replayed with fresh inputs and checked against
the float64 reference; the FlashInfer entry on the same world.
"""
from __future__ import annotations

import gc
import math
import pathlib
import random
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dispatch
from dispatch import op as dop
from dispatch.call_arguments import CALL_DEFAULTS
from dispatch.call_plan import CallPlan
from dispatch.outputs import allocate_outputs
from dispatch import gpu_facts, table_sets, torch_op
from dispatch.flashinfer_compat import trtllm_moe_finalize_allreduce_fusion
from dispatch.workspace_state import WorkspaceState

OP = torch.ops.moe_ar.moe_finalize_allreduce
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class StubWorkspace:
    """What the op and dispatch.op.prepare_call read from a workspace, without a GPU."""

    def __init__(self, device="meta", hidden=256, dtype=torch.bfloat16, world_size=2, rank=0, max_tokens=512):
        self.device = torch.device(device)
        self.hidden, self.dtype, self.dtype_name = hidden, dtype, DTYPE_NAMES[dtype]
        self.world_size, self.rank, self.max_tokens = world_size, rank, max_tokens
        self.oneshot_max_tokens = min(max_tokens, 1024)
        self.selection = table_sets.resolve(dtype=self.dtype_name, world_size=world_size, hidden=hidden,
                                            elem_bytes=dtype.itemsize, device=gpu_facts.UNKNOWN_DEVICE, user=None,
                                            program_set_sha256="")
        self._moe_ar_state = WorkspaceState()
        self._moe_ar_state.memory = types.SimpleNamespace(error=[0])  # no timeout recorded
        self.launched = []


_KEEP = []  # the registry holds workspaces weakly: keep the stubs of a handle alive


def handle_of(ws) -> int:
    _KEEP.append(ws)
    return dispatch.workspace_handle(ws)


def make_args(T, K, H, dtype=torch.bfloat16, device="meta", *, rows=None, scale=None, shared=False, seed=0):
    """Positional inputs (allreduce_in, idx, residual_in, norm_weight) and optional kwargs."""
    g = torch.Generator().manual_seed(seed)
    R = T * K if rows is None else rows
    x = torch.randn(R, H, generator=g).to(dtype)
    idx = torch.randperm(R, generator=g)[: T * K].reshape(T, K).to(torch.int32)
    if T * K:
        idx.view(-1)[:: 3] = -1  # dropped routes
    res = torch.randn(T, H, generator=g).to(dtype)
    gamma = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    kw = {}
    if scale is not None:
        kw["expert_scale_factor"] = torch.rand(T, K, generator=g).to(scale)
    if shared:
        kw["shared_expert_output"] = torch.randn(T, H, generator=g).to(dtype)
    pos = [x, idx, res, gamma]
    to = (lambda t: t.to(device)) if device != "meta" else (lambda t: torch.empty_like(t, device="meta"))
    return [to(t) for t in pos], {k: to(v) for k, v in kw.items()}


def meta_inputs(T, K, H, dtype=torch.bfloat16, **kw):
    pos, extra = make_args(T, K, H, dtype, "meta", **kw)
    return dict(allreduce_in=pos[0], expanded_idx_to_permuted_idx=pos[1], residual_in=pos[2], norm_weight=pos[3],
                **extra)


# ---- the handle registry ------------------------------------------------------------------------

def test_workspace_handle_is_stable_unique_and_weak():
    a, b = StubWorkspace(), StubWorkspace()
    ha, hb = dispatch.workspace_handle(a), dispatch.workspace_handle(b)
    assert isinstance(ha, int) and isinstance(hb, int) and ha != hb and min(ha, hb) >= 2
    assert dispatch.workspace_handle(a) == ha
    assert dispatch.workspace_from_handle(ha) is a and dispatch.workspace_from_handle(hb) is b
    del a
    gc.collect()
    with pytest.raises(ValueError, match=r"^workspace: no live workspace has handle"):
        dispatch.workspace_from_handle(ha)
    c = StubWorkspace()
    assert dispatch.workspace_handle(c) not in (ha, hb)  # handles are never reused


@pytest.mark.parametrize("bad", ["not a workspace", 3.5, object()])
def test_workspace_handle_rejects_non_workspaces(bad):
    with pytest.raises(ValueError, match=r"^workspace: "):
        dispatch.workspace_handle(bad)


def test_workspace_handle_rejects_an_emulated_world_itself():
    EmulatedWorld = type("EmulatedWorld", (), {})
    with pytest.raises(ValueError, match=r"^workspace: an EmulatedWorld holds one workspace per rank"):
        dispatch.workspace_handle(EmulatedWorld())


@pytest.mark.parametrize("bad", [10 ** 9, True, "1", None])
def test_unknown_handles_are_named(bad):
    with pytest.raises(ValueError, match=r"^workspace: "):
        dispatch.workspace_from_handle(bad)


# ---- the fake implementation ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", [None, "nvfp4"])
@pytest.mark.parametrize("T,H", [(1, 256), (5, 2064), (130, 7168), (257, 2048)])
def test_fake_outputs_follow_the_inputs(dtype, quant, T, H):
    """Under FakeTensorMode with fake CUDA tensors (no GPU here): shapes, dtypes and the device
    (cuda:1, not the default one) of all four outputs; NVFP4 vs None."""
    dev = torch.device("cuda", 1)
    ws = StubWorkspace(dev, hidden=H, dtype=dtype)
    h = dispatch.workspace_handle(ws)
    K = 3
    with FakeTensorMode():
        x = torch.empty(T * K + 7, H, dtype=dtype, device=dev)
        idx = torch.empty(T, K, dtype=torch.int32, device=dev)
        res = torch.empty(T, H, dtype=dtype, device=dev)
        gamma = torch.empty(H, dtype=dtype, device=dev)
        gs = torch.empty(1, dtype=torch.float32, device=dev) if quant else None
        outs = OP(h, x, idx, res, gamma, expert_scale_factor=torch.empty(T, K, device=dev), quant=quant,
                  global_scale=gs)
    assert len(outs) == 4
    norm, resid, q, s = outs
    for t in outs:
        assert t.device == dev
    assert (tuple(norm.shape), norm.dtype) == ((T, H), dtype)
    assert (tuple(resid.shape), resid.dtype) == ((T, H), dtype)
    if quant == "nvfp4":
        assert (tuple(q.shape), q.dtype) == ((T, H // 2), torch.uint8)
        assert (tuple(s.shape), s.dtype) == ((dispatch.scale_out_bytes(T, H),), torch.uint8)
    else:
        assert (tuple(q.shape), q.dtype) == ((0,), torch.uint8)
        assert (tuple(s.shape), s.dtype) == ((0,), torch.uint8)


@pytest.mark.parametrize("quant,layout", [(None, "row"), ("nvfp4", "row"), ("fp8_group128", "row"),
                                          ("fp8_group128", "column"), ("fp8_tensor", "row")])
@pytest.mark.parametrize("T,H", [(3, 256), (129, 2048)])
def test_fake_matches_the_runtime_allocation(quant, layout, T, H):
    """The fake's outputs have the shapes and dtypes dispatch.outputs.allocate_outputs gives the real
    call (what the kernel writes when no outputs are passed)."""
    ws = StubWorkspace("cpu", hidden=H)
    kw = dict(expanded_idx_to_permuted_idx=torch.zeros(T, 2, dtype=torch.int32), quant=quant,
              fp8_scale_layout=layout)
    real = allocate_outputs(ws, kw)
    h = handle_of(StubWorkspace("meta", hidden=H))
    gs = torch.empty(1, device="meta") if quant in ("nvfp4", "fp8_tensor") else None
    scale_arg = dict(fp8_scale=gs) if quant == "fp8_tensor" else dict(global_scale=gs)
    fake = dispatch.moe_finalize_allreduce_op(h, **meta_inputs(T, 2, H), quant=quant, fp8_scale_layout=layout,
                                              **scale_arg)
    names = ["norm_out", "residual_out"] + {None: [], "fp8_tensor": ["quant_out"]}.get(quant, ["quant_out", "scale_out"])
    for name in names:
        assert (tuple(real[name].shape), real[name].dtype) == (tuple(getattr(fake, name).shape),
                                                             getattr(fake, name).dtype), name
    if not quant:
        assert fake.quant_out is None and fake.scale_out is None


BAD_CALLS = [
    ("expanded_idx_to_permuted_idx", dict(expanded_idx_to_permuted_idx=("empty", (4, 2), torch.int64))),
    ("expanded_idx_to_permuted_idx", dict(expanded_idx_to_permuted_idx=("empty", (5, 2), torch.int32))),
    ("expanded_idx_to_permuted_idx", dict(expanded_idx_to_permuted_idx=("empty", (4, 17), torch.int32),
                                          allreduce_in=("empty", (68, 256), torch.bfloat16))),
    ("allreduce_in", dict(allreduce_in=("empty", (8, 128), torch.bfloat16))),
    ("allreduce_in", dict(allreduce_in=("empty", (7, 256), torch.bfloat16))),
    ("allreduce_in", dict(allreduce_in=("empty", (8, 256), torch.float16))),
    ("residual_in", dict(residual_in=("empty", (4, 256), torch.float32))),
    ("residual_in", dict(residual_in=("empty", (4, 256), torch.float16),
                         allreduce_in=("empty", (8, 256), torch.float16),
                         norm_weight=("empty", (256,), torch.float16))),  # the workspace is bf16
    ("norm_weight", dict(norm_weight=("empty", (255,), torch.bfloat16))),
    ("expert_scale_factor", dict(expert_scale_factor=("empty", (4, 3), torch.float32))),
    ("expert_scale_factor", dict(expert_scale_factor=("empty", (4, 2), torch.int32))),
    ("shared_expert_output", dict(shared_expert_output=("empty", (3, 256), torch.bfloat16))),
    ("quant", dict(quant="fp8")),
    ("global_scale", dict(quant="nvfp4")),
    ("global_scale", dict(quant="nvfp4", global_scale=("empty", (2,), torch.float32))),
    ("weight_bias", dict(weight_bias=2)),
    ("norm_weight", dict(norm_weight=("cpu", (256,), torch.bfloat16))),  # another device
    ("fp8_scale", dict(quant="fp8_tensor")),
    ("fp8_scale", dict(quant="fp8_tensor", fp8_scale=("empty", (1,), torch.float16))),
    ("fp8_scale_layout", dict(quant="fp8_group128", fp8_scale_layout="col")),
]


@pytest.mark.parametrize("name,change", BAD_CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CALLS)])
def test_fake_names_the_bad_argument(name, change):
    h = handle_of(StubWorkspace("meta", hidden=256))
    kw = meta_inputs(4, 2, 256)
    for k, v in change.items():
        if isinstance(v, tuple):
            dev = "cpu" if v[0] == "cpu" else "meta"
            kw[k] = torch.empty(v[1], dtype=v[2], device=dev)
        else:
            kw[k] = v
    with pytest.raises(ValueError, match=rf"^{name}: "):
        dispatch.moe_finalize_allreduce_op(h, **kw)


def test_fake_checks_the_workspace_hidden_and_device():
    kw = meta_inputs(4, 2, 256)
    with pytest.raises(ValueError, match=r"^residual_in: hidden 256, the workspace was made for hidden 512"):
        dispatch.moe_finalize_allreduce_op(handle_of(StubWorkspace("meta", hidden=512)), **kw)
    with pytest.raises(ValueError, match=r"^residual_in: on meta, expected the workspace's device cuda:0"):
        dispatch.moe_finalize_allreduce_op(handle_of(StubWorkspace("cuda:0")), **kw)
    with pytest.raises(ValueError, match=r"^workspace: no live workspace"):
        dispatch.moe_finalize_allreduce_op(10 ** 8, **kw)


# ---- the real implementation, launch replaced by a CPU computation -------------------------------

def cpu_math(a, T, K, H, world_size):
    """Outputs of a call whose W ranks all hold this rank's inputs (the kernel's math, fp32)."""
    x, idx = a["allreduce_in"].float(), a["expanded_idx_to_permuted_idx"].long()
    scale = a["expert_scale_factor"]
    acc = torch.zeros(T, H)
    for k in range(K):
        ok = idx[:, k] >= 0
        w = torch.ones(T) if scale is None else scale[:, k].float()
        acc[ok] += w[ok, None] * x[idx[ok, k]]
    acc *= a["routed_scaling_factor"]
    if a["shared_expert_output"] is not None:
        acc += a["shared_expert_output"].float()
    D = a["residual_in"].dtype
    s = acc.to(D).float() * world_size
    res = (s + a["residual_in"].float()).to(D)
    r = res.float()
    norm = r * torch.rsqrt(r.square().mean(-1, keepdim=True) + a["eps"]) * (a["norm_weight"].float() + a["weight_bias"])
    return res, norm.to(D)


class CpuLauncher:
    """Stands in for dispatch.launcher._Launcher: records the call and writes cpu_math into the outputs."""

    def __init__(self, ws, name):
        info = dispatch.program_info(name)
        self.name, self.family, self.profile, self.regime = name, info["family"], info["profile"], info["regime"]
        self.ws = ws

    def kernel_call(self, ws, T, a, order):
        return dict(T=T, K=a["expanded_idx_to_permuted_idx"].shape[1], R=a["allreduce_in"].shape[0],
                    pdl=a["launch_with_pdl"])

    def run(self, plan, a):
        """In place of the kernel launch: what the kernel would write, computed on the CPU."""
        ws, k = self.ws, plan.kernel
        ws.launched.append(dict(program=self.name, T=k["T"], K=k["K"], R=k["R"], pdl=k["pdl"], quant=a.get("quant")))
        res, norm = cpu_math(dict(CALL_DEFAULTS, **a), k["T"], k["K"], ws.hidden, ws.world_size)
        a["residual_out"].copy_(res)
        a["norm_out"].copy_(norm)
        if self.profile == "nvfp4":
            a["quant_out"].fill_(0x5A)
            a["scale_out"].fill_(0x33)


def _cpu_run(plan, pointers, kw):
    if plan.kernel is not None:
        with torch.no_grad():  # a kernel launch records no autograd history
            plan.launcher.run(plan, kw)
    return plan.outputs(kw)


@pytest.fixture
def cpu_runtime(monkeypatch):
    """A CPU stub workspace whose calls run dispatch.op for real up to the kernel launch."""
    monkeypatch.setattr(dop, "launcher_for", lambda ws, name: ws._moe_ar_state.launchers.setdefault(name, CpuLauncher(ws, name)))
    monkeypatch.setattr(CallPlan, "run", _cpu_run)
    return StubWorkspace("cpu", hidden=256)


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_real_impl_passes_every_argument_through(cpu_runtime, quant):
    ws = cpu_runtime
    h = dispatch.workspace_handle(ws)
    T, K, H = 6, 3, 256
    pos, extra = make_args(T, K, H, device="cpu", rows=T * K + 5, scale=torch.float32, shared=True, seed=3)
    a = dict(allreduce_in=pos[0], expanded_idx_to_permuted_idx=pos[1], residual_in=pos[2], norm_weight=pos[3],
             **extra, routed_scaling_factor=1.75, eps=1e-3, weight_bias=1)
    gs = torch.tensor([3.0]) if quant else None
    out = dispatch.moe_finalize_allreduce_op(h, **a, quant=quant, global_scale=gs, launch_with_pdl=True)
    assert ws.launched == [dict(program=dispatch.select_program(ws, T, quant, True), T=T, K=K, R=T * K + 5,
                                pdl=True, quant=quant)]
    res, norm = cpu_math(a, T, K, H, ws.world_size)
    assert torch.equal(out.residual_out, res) and torch.equal(out.norm_out, norm)
    if quant:
        assert out.quant_out.shape == (T, H // 2) and bool((out.quant_out == 0x5A).all())
        assert out.scale_out.shape == (dispatch.scale_out_bytes(T, H),) and bool((out.scale_out == 0x33).all())
    else:
        assert out.quant_out is None and out.scale_out is None
        raw = OP(h, *pos, expert_scale_factor=a["expert_scale_factor"])
        assert [tuple(t.shape) for t in raw[2:]] == [(0,), (0,)] and all(t.dtype == torch.uint8 for t in raw[2:])
    # a forced program reaches the runtime too (and a wrong one is refused by it, by name)
    forced = dispatch.select_program(ws, T, quant, False)
    dispatch.moe_finalize_allreduce_op(h, **a, quant=quant, global_scale=gs, program=forced)
    assert ws.launched[-1]["program"] == forced
    other = dispatch.select_program(ws, T, "nvfp4" if quant is None else None, False)
    with pytest.raises(ValueError, match=r"^program: "):
        dispatch.moe_finalize_allreduce_op(h, **a, quant=quant, global_scale=gs, program=other)


def test_real_impl_errors_are_the_runtimes(cpu_runtime):
    h = dispatch.workspace_handle(cpu_runtime)
    pos, _ = make_args(4, 2, 256, device="cpu")
    with pytest.raises(ValueError, match=r"^expanded_idx_to_permuted_idx: 600 tokens, more than"):
        big, _ = make_args(600, 1, 256, device="cpu")
        OP(h, *big)
    cpu_runtime._moe_ar_state.closed = True
    with pytest.raises(ValueError, match=r"^workspace: this workspace was closed"):
        OP(h, *pos)


OUT_OP = torch.ops.moe_ar.moe_finalize_allreduce_out


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_out_variant_writes_the_given_outputs(cpu_runtime, quant):
    """moe_ar::moe_finalize_allreduce_out: the same call with outputs given, written in place."""
    ws = cpu_runtime
    h = dispatch.workspace_handle(ws)
    T, K, H = 6, 3, 256
    pos, extra = make_args(T, K, H, device="cpu", rows=T * K + 5, scale=torch.float32, shared=True, seed=4)
    norm_out, residual_out = torch.full((T, H), float("nan"), dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
    residual_out.fill_(float("nan"))
    q = torch.zeros(T, H // 2, dtype=torch.uint8) if quant else None
    sc = torch.zeros(dispatch.scale_out_bytes(T, H), dtype=torch.uint8) if quant else None
    gs = torch.tensor([3.0]) if quant else None
    assert OUT_OP(h, *pos, norm_out, residual_out, q, sc, **extra, routed_scaling_factor=1.75, eps=1e-3,
                  weight_bias=1, quant=quant, global_scale=gs) is None
    a = dict(allreduce_in=pos[0], expanded_idx_to_permuted_idx=pos[1], residual_in=pos[2], norm_weight=pos[3],
             **extra, routed_scaling_factor=1.75, eps=1e-3, weight_bias=1)
    res, norm = cpu_math(a, T, K, H, ws.world_size)
    assert torch.equal(residual_out, res) and torch.equal(norm_out, norm)
    if quant:
        assert bool((q == 0x5A).all()) and bool((sc == 0x33).all())
    assert ws.launched[-1]["program"] == dispatch.select_program(ws, T, quant, True)
    with pytest.raises(ValueError, match=r"^norm_out: shape \(5, 256\), expected \(6, 256\)"):
        OUT_OP(h, *pos, norm_out[:5], residual_out, q, sc, **extra, quant=quant, global_scale=gs)
    with pytest.raises(ValueError, match=r"^norm_out: overlaps residual_in"):
        OUT_OP(h, *pos, pos[2], residual_out, q, sc, **extra, quant=quant, global_scale=gs)
    if quant:  # an output the quant writes left out is refused, not allocated and dropped
        with pytest.raises(ValueError, match=r"^quant_out: required"):
            OUT_OP(h, *pos, norm_out, residual_out, None, sc, **extra, quant=quant, global_scale=gs)
        with pytest.raises(ValueError, match=r"^scale_out: required"):
            OUT_OP(h, *pos, norm_out, residual_out, q, None, **extra, quant=quant, global_scale=gs)


def test_autograd_falls_through_both_ops(cpu_runtime):
    """Inputs that require grad (a Parameter norm_weight, eager code outside no_grad): the ops run,
    their outputs do not require grad, and a backward through them is an error, not a gradient."""
    h = dispatch.workspace_handle(cpu_runtime)
    pos, extra = make_args(6, 3, 256, device="cpu", scale=torch.float32, shared=True, seed=5)
    weight = torch.nn.Parameter(pos[3].clone())
    with torch.enable_grad():
        outs = OP(h, pos[0], pos[1], pos[2], weight, **extra)
        n, r = torch.empty_like(pos[2]), torch.empty_like(pos[2])
        OUT_OP(h, pos[0], pos[1], pos[2], weight, n, r, **extra)
    assert not any(t.requires_grad for t in (*outs, n, r))
    with pytest.raises(RuntimeError, match="does not require grad"):
        outs[0].float().sum().backward()
    assert weight.grad is None


def test_out_variant_is_refused_under_compile():
    torch._dynamo.reset()
    h = handle_of(StubWorkspace("meta", hidden=256))

    def f(a):
        n, r = torch.empty_like(a["residual_in"]), torch.empty_like(a["residual_in"])
        OUT_OP(h, a["allreduce_in"], a["expanded_idx_to_permuted_idx"], a["residual_in"], a["norm_weight"], n, r)
        return a["residual_in"] + 1

    with pytest.raises(Exception, match="moe_finalize_allreduce_out: for eager calls and CUDA-graph capture"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(meta_inputs(3, 2, 256))


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_opcheck_real_against_fake(cpu_runtime, quant):
    """torch.library.opcheck: schema (no input mutated, outputs alias nothing), fake tensor
    consistency with the real implementation, AOT dispatch with dynamic shapes."""
    h = dispatch.workspace_handle(cpu_runtime)
    pos, extra = make_args(5, 2, 256, device="cpu", scale=torch.bfloat16, shared=True)
    kw = dict(extra, routed_scaling_factor=0.5, quant=quant,
              global_scale=torch.tensor([2.0]) if quant else None)
    result = torch.library.opcheck(OP.default, (h, *pos), kw)
    assert all(v == "SUCCESS" for v in result.values()), result


# ---- torch.compile ------------------------------------------------------------------------------

def _tail(h, x, idx, res, gamma, logits):
    """A model tail around the op: router weights before, a consumer of its outputs after."""
    scale = torch.softmax(logits.float(), dim=-1)
    out = dispatch.moe_finalize_allreduce_op(h, allreduce_in=x, expanded_idx_to_permuted_idx=idx, residual_in=res,
                                             norm_weight=gamma, expert_scale_factor=scale, eps=1e-5)
    return out.norm_out.float().square().mean(-1), out.residual_out


def _op_nodes(gm):
    found = []
    for n in gm.graph.nodes:
        if n.target is OP or n.target is OP.default:
            found.append(n)
        elif n.target is torch.ops.higher_order.with_effects and OP.default in n.args:
            found.append(n)
    return found


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("by", ["handle", "workspace"])
def test_compile_fullgraph_no_graph_break(backend, by):
    from torch._dynamo.testing import AotEagerAndRecordGraphs, EagerAndRecordGraphs
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    ws = StubWorkspace("meta", hidden=256)
    h = dispatch.workspace_handle(ws)
    rec = EagerAndRecordGraphs() if backend == "eager" else AotEagerAndRecordGraphs()
    fn = torch.compile(_tail, backend=rec, fullgraph=True)
    a = meta_inputs(7, 4, 256)
    logits = torch.empty(7, 4, device="meta")
    mean_sq, resid = fn(h if by == "handle" else ws, a["allreduce_in"], a["expanded_idx_to_permuted_idx"],
                        a["residual_in"], a["norm_weight"], logits)
    assert (tuple(mean_sq.shape), mean_sq.dtype) == ((7,), torch.float32)
    assert (tuple(resid.shape), resid.dtype, resid.device.type) == ((7, 256), torch.bfloat16, "meta")
    assert len(rec.graphs) == 1 and len(_op_nodes(rec.graphs[0])) == 1
    if backend == "aot_eager":
        assert len(rec.fw_graphs) == 1 and len(_op_nodes(rec.fw_graphs[0])) == 1
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compile_keeps_unused_calls_in_order():
    """The op is an ordered side effect: AOT graphs keep a call whose outputs are unused, and
    two independent calls stay in program order (a collective must not be dropped or swapped)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    torch._dynamo.reset()
    h1 = handle_of(StubWorkspace("meta", hidden=256))
    h2 = handle_of(StubWorkspace("meta", hidden=512))

    def f(a1, a2):
        dispatch.moe_finalize_allreduce_op(h2, **a2)  # outputs unused
        out = dispatch.moe_finalize_allreduce_op(h1, **a1)
        return out.residual_out + 1

    rec = AotEagerAndRecordGraphs()
    torch.compile(f, backend=rec, fullgraph=True)(meta_inputs(3, 2, 256), meta_inputs(3, 2, 512))
    calls = _op_nodes(rec.fw_graphs[0])
    assert torch_op.EFFECT_REGISTERED
    assert len(calls) == 2, rec.fw_graphs[0].code
    handles = [next(a for a in n.args if isinstance(a, int) and not isinstance(a, bool)) for n in calls]
    assert handles == [h2, h1], rec.fw_graphs[0].code


def test_compile_dynamic_one_graph_for_every_rank():
    """With dynamic=True the handle is a SymInt: one graph serves every rank's workspace and
    token count (an emulated world can compile once before any rank launches)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    handles = [handle_of(StubWorkspace("meta", hidden=256, rank=r)) for r in range(2)]
    cnt = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_tail, backend=cnt, fullgraph=True, dynamic=True)
    first = None
    for T in (5, 9, 33):
        for h in handles:
            a = meta_inputs(T, 4, 256)
            _, resid = fn(h, a["allreduce_in"], a["expanded_idx_to_permuted_idx"], a["residual_in"],
                          a["norm_weight"], torch.empty(T, 4, device="meta"))
            assert tuple(resid.shape) == (T, 256)
            first = cnt.frame_count if first is None else first
    # (the first compile may restart its analysis once, which the counter also counts)
    assert first >= 1 and cnt.frame_count == first, "recompiled for another rank's handle or another T"


def test_make_fx_fake_tracing():
    from torch.fx.experimental.proxy_tensor import make_fx
    h = handle_of(StubWorkspace("cuda:0", hidden=256))

    def f(x, idx, res, gamma, gs):
        return OP(h, x, idx, res, gamma, quant="nvfp4", global_scale=gs)

    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = "cuda:0"
        args = (torch.empty(8, 256, dtype=torch.bfloat16, device=dev), torch.empty(4, 2, dtype=torch.int32, device=dev),
                torch.empty(4, 256, dtype=torch.bfloat16, device=dev), torch.empty(256, dtype=torch.bfloat16, device=dev),
                torch.empty(1, device=dev))
    gm = make_fx(f, tracing_mode="fake")(*args)
    calls = [n for n in gm.graph.nodes if n.target is OP.default]
    assert len(calls) == 1
    vals = calls[0].meta["val"]
    assert [tuple(v.shape) for v in vals] == [(4, 256), (4, 256), (4, 128), (dispatch.scale_out_bytes(4, 256),)]
    assert all(v.device == torch.device(dev) for v in vals)


# ---- the FlashInfer-compatible entry ------------------------------------------------------------

def _fi_args(ws, T=4, K=2, H=256, device="cpu", quant=False, **over):
    pos, extra = make_args(T, K, H, device=device, scale=torch.float32, shared=True, seed=7)
    a = dict(allreduce_in=pos[0], residual_in=pos[2], norm_weight=pos[3], expanded_idx_to_permuted_idx=pos[1],
             norm_out=torch.full((T, H), math.nan, dtype=torch.bfloat16, device=device),
             residual_out=torch.full((T, H), math.nan, dtype=torch.bfloat16, device=device),
             quant_out=torch.zeros(T, H // 2, dtype=torch.uint8, device=device) if quant else None,
             scale_out=torch.zeros(dispatch.scale_out_bytes(T, H), dtype=torch.uint8, device=device) if quant else None,
             workspace_ptrs=ws, launch_with_pdl=False, world_rank=ws.rank, world_size=ws.world_size, eps=1e-6,
             shared_expert_output=extra["shared_expert_output"], expert_scale_factor=extra["expert_scale_factor"],
             routed_scaling_factor=2.0, weight_bias=None)
    a.update(over)
    return a


FI_BAD = [
    ("workspace_ptrs", dict(workspace_ptrs=torch.zeros(8, dtype=torch.int64))),
    ("workspace_ptrs", dict(workspace_ptrs="ws")),
    ("world_rank", dict(world_rank=1)),
    ("world_size", dict(world_size=4)),
    ("weight_bias", dict(weight_bias=0.5)),
    ("scale_out", dict(quant_out=torch.zeros(4, 128, dtype=torch.uint8))),
    ("quant_out", dict(scale_out=torch.zeros(2048, dtype=torch.uint8))),
    ("global_scale", dict(quant_out=torch.zeros(4, 128, dtype=torch.uint8),
                          scale_out=torch.zeros(2048, dtype=torch.uint8))),
    ("quant_out", dict(quant_out=torch.zeros(4, 64, dtype=torch.uint8), scale_out=torch.zeros(2048, dtype=torch.uint8),
                       global_scale=torch.ones(1))),
    ("scale_out", dict(quant_out=torch.zeros(4, 128, dtype=torch.uint8), scale_out=torch.zeros(100, dtype=torch.uint8),
                       global_scale=torch.ones(1))),
    ("backend", dict(backend="nccl")),
    ("backend", dict(backend="cake")),  # a FlashInfer backend name of other ops, not of all-reduce fusion
    ("backend", dict(backend="mnnvl")),  # FlashInfer's NVLink multicast kernels, which this entry does not run
    ("norm_out", dict(norm_out=torch.zeros(4, 256, dtype=torch.float16))),
]


@pytest.mark.parametrize("name,over", FI_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FI_BAD)])
def test_flashinfer_entry_names_what_it_cannot_honor(cpu_runtime, name, over):
    a = _fi_args(cpu_runtime, **over)
    backend = a.pop("backend", "trtllm")
    kw = {k: a.pop(k) for k in ("global_scale",) if k in a}
    with pytest.raises(ValueError, match=rf"^{name}: "):
        trtllm_moe_finalize_allreduce_fusion(**a, backend=backend, **kw)
    assert cpu_runtime.launched == []


@pytest.mark.parametrize("weight_bias,expect", [(None, 0), (0.0, 0), (1.0, 1)])
@pytest.mark.parametrize("backend", ["trtllm", "auto"])
def test_flashinfer_entry_maps_arguments_and_writes_in_place(cpu_runtime, weight_bias, expect, backend):
    ws = cpu_runtime
    a = _fi_args(ws, weight_bias=weight_bias)
    positional = [a[k] for k in ("allreduce_in", "residual_in", "norm_weight", "expanded_idx_to_permuted_idx",
                                 "norm_out", "residual_out", "quant_out", "scale_out", "workspace_ptrs",
                                 "launch_with_pdl", "world_rank", "world_size", "eps", "shared_expert_output",
                                 "expert_scale_factor", "routed_scaling_factor", "weight_bias")]
    out = trtllm_moe_finalize_allreduce_fusion(*positional, backend=backend)  # FlashInfer's positional order
    assert out.norm_out is a["norm_out"] and out.residual_out is a["residual_out"]
    ref_res, ref_norm = cpu_math(dict(a, weight_bias=expect), 4, 2, 256, ws.world_size)
    assert torch.equal(a["residual_out"], ref_res) and torch.equal(a["norm_out"], ref_norm)
    assert out.quant_out is None and ws.launched[-1]["quant"] is None


@pytest.mark.parametrize("qdtype,shape", [(torch.uint8, (4, 128)), (torch.int64, (4, 16)),
                                          (torch.float4_e2m1fn_x2, (4, 128))])
def test_flashinfer_entry_nvfp4_buffers_are_reinterpreted(cpu_runtime, qdtype, shape):
    a = _fi_args(cpu_runtime, quant=True, routed_scaling_factor=None)
    a["quant_out"] = torch.zeros(shape, dtype=torch.uint8).view(qdtype) if qdtype != torch.int64 else \
        torch.zeros(shape, dtype=torch.int64)
    a["scale_out"] = torch.zeros(dispatch.scale_out_bytes(4, 256) // 4, dtype=torch.int32)
    out = trtllm_moe_finalize_allreduce_fusion(**a, global_scale=torch.tensor([1.0]))
    assert out.quant_out is a["quant_out"] and out.scale_out is a["scale_out"]
    assert bool((a["quant_out"].view(torch.uint8) == 0x5A).all())
    assert bool((a["scale_out"].view(torch.uint8) == 0x33).all())
    assert cpu_runtime.launched[-1]["quant"] == "nvfp4"
    ref_res, _ = cpu_math(dict(a, routed_scaling_factor=1.0, weight_bias=0), 4, 2, 256, 2)
    assert torch.equal(a["residual_out"], ref_res)


def test_flashinfer_entry_compiles_without_graph_break():
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    ws = StubWorkspace("meta", hidden=256)
    dispatch.workspace_handle(ws)
    a = _fi_args(ws, device="meta", quant=True)
    a = {k: (torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    gs = torch.empty(1, device="meta")
    rec = AotEagerAndRecordGraphs()

    def f(a, gs):
        out = trtllm_moe_finalize_allreduce_fusion(**a, global_scale=gs)
        return out.norm_out.sum()

    torch.compile(f, backend=rec, fullgraph=True)(a, gs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(_op_nodes(rec.fw_graphs[0])) == 1


# ---- GPU: compile + CUDA graph capture on an emulated world of two ranks --------------------------

def _reference():
    from moe_ar_tools import reference
    return reference


def _call_ranks(fn, handles, inputs, streams):
    """Every rank's call on its own stream (as EmulatedWorld.run does), joined back to the current
    stream; all ranks' inputs were built before, so no rank is launched alone into an error."""
    cur = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(cur)
    outs = []
    for h, kw, s in zip(handles, inputs, streams):
        with torch.cuda.stream(s):
            outs.append(fn(h, **kw))
    for s in streams:
        cur.wait_stream(s)
    return outs


def _tail_gpu(h, allreduce_in, expanded_idx_to_permuted_idx, residual_in, norm_weight, scale_bf16, shared,
              rsf: float, weight_bias: int, quant, global_scale):
    """The compiled function: a compiled kernel feeding the op (router weights bf16 -> fp32, an
    exact conversion), then the op. Nothing after the op on purpose: in one process, a kernel
    module loaded for the first time while a rank's op kernel waits for its peer (not launched
    yet) may wait for that kernel (CUDA may synchronize the context to load a module), a
    deadlock that separate processes cannot have."""
    return dispatch.moe_finalize_allreduce_op(
        h, allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx,
        residual_in=residual_in, norm_weight=norm_weight, expert_scale_factor=scale_bf16.float(),
        routed_scaling_factor=rsf, shared_expert_output=shared, eps=1e-6, weight_bias=weight_bias, quant=quant,
        global_scale=global_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "nvfp4"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_op_in_cuda_graph_on_emulated_world(backend, quant, seed_for, record_result):
    """torch.compile(fullgraph=True, dynamic=True) of a function calling the op, run for both
    ranks of an EmulatedWorld(2) on one GPU, each rank on its own stream; eager runs first
    (world.run builds every rank's launcher before any rank launches, then the compiled function
    compiles and runs per rank), then one CUDA graph holding both ranks' calls at two token
    counts (a small one, and one past 256 where bf16 world size 2 leaves one-shot for profile
    110), replayed with fresh inputs copied into the captured ones and every replay checked
    against the float64 reference and across ranks bit for bit. Python scalars (routed scaling
    factor, weight bias) are baked into the graph: they stay fixed per captured call, while
    global_scale, a device tensor, changes between replays."""
    ref = _reference()
    if backend == "inductor":
        from torch.utils._triton import has_triton
        if not has_triton():
            pytest.skip("inductor needs triton")
    import torch._inductor.config as inductor_config
    rnd = random.Random(seed_for("plan"))
    W, H, K, dtype, max_tokens = 2, 2048, 4, torch.bfloat16, 384
    torch._dynamo.reset()
    # generous deadline: a rank's kernel waits for its peer while the peer's call is on the host
    world = dispatch.EmulatedWorld(W, max_tokens, H, dtype, timeout_s=60.0)
    try:
        handles = [dispatch.workspace_handle(w) for w in world.workspaces]
        streams = [torch.cuda.Stream() for _ in range(W)]
        fn = torch.compile(_tail_gpu, backend=backend, fullgraph=True, dynamic=True)
        slots = [dict(T=T, rsf=ref.f32(rnd.uniform(0.5, 2.0)), wb=rnd.randint(0, 1), padded=rnd.randint(0, 20))
                 for T in (rnd.randint(2, 64), rnd.randint(300, max_tokens))]

        def fresh(slot, seed):
            case = ref.make_case(W, slot["T"], H, K, dtype, seed=seed, device="cuda", scale_kind="fp32",
                                 shared=True, rsf=slot["rsf"], weight_bias=slot["wb"], drop_frac=0.2,
                                 padded_rows=slot["padded"])
            for kw in case:  # router weights exactly representable in bf16 (the compiled function converts)
                kw["expert_scale_factor"] = kw["expert_scale_factor"].to(torch.bfloat16).float()
            gs = ref.f32(ref.typical_global_scale(ref.reference_for(case)["norm_out"])) if quant else None
            return case, gs

        def compiled_kwargs(case, gs_t):
            return [dict(allreduce_in=kw["allreduce_in"], expanded_idx_to_permuted_idx=kw["expanded_idx_to_permuted_idx"],
                         residual_in=kw["residual_in"], norm_weight=kw["norm_weight"],
                         scale_bf16=kw["expert_scale_factor"].to(torch.bfloat16), shared=kw["shared_expert_output"],
                         rsf=case.meta["rsf"], weight_bias=case.meta["weight_bias"], quant=quant,
                         global_scale=gs_t[r] if quant else None)
                    for r, kw in enumerate(case)]

        def check(case, gs, outs, label):
            torch.cuda.synchronize()
            world.check()
            ref.check_outputs(case, outs, quant=quant, global_scale=gs, nvfp4_device="cuda", label=label)

        checked = 0
        with inductor_config.patch({"triton.autotune_pointwise": False}):
            for i, slot in enumerate(slots):
                case, gs = fresh(slot, seed_for(f"warm{i}"))
                slot["case"] = case
                slot["gs_t"] = [torch.tensor([gs if quant else 1.0], dtype=torch.float32, device="cuda")
                                for _ in range(W)]
                eager = [dict(kw, quant=quant, global_scale=slot["gs_t"][r] if quant else None)
                         for r, kw in enumerate(case)]
                check(case, gs, world.run(eager), f"world.run T={slot['T']}")  # launchers, programs loaded
                slot["kws"] = compiled_kwargs(case, slot["gs_t"])
                check(case, gs, _call_ranks(fn, handles, slot["kws"], streams), f"{backend} eager T={slot['T']}")
                checked += 2
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for slot in slots:
                    slot["outs"] = _call_ranks(fn, handles, slot["kws"], streams)
            torch.cuda.synchronize()
            for rep in range(6):
                for j, slot in enumerate(slots):
                    case, gs = fresh(slot, seed_for(f"replay{rep}.{j}"))
                    for dst, src in zip(slot["case"], case):  # new values into the captured inputs
                        for k, v in dst.items():
                            if isinstance(v, torch.Tensor):
                                v.copy_(src[k])
                    for dst, src in zip(slot["kws"], compiled_kwargs(case, slot["gs_t"])):
                        dst["scale_bf16"].copy_(src["scale_bf16"])
                    if quant:
                        for t in slot["gs_t"]:
                            t.fill_(gs)
                    for o in slot["outs"]:
                        for t in o:
                            if t is not None:
                                t.fill_(math.nan if t.is_floating_point() else 0xAB)
                    slot["fresh"] = (case, gs)
                g.replay()
                for slot in slots:
                    check(*slot["fresh"], slot["outs"], f"{backend} replay {rep} T={slot['T']}")
                    checked += 1
        record_result(program=f"compiled op {backend} quant={quant}", cases=checked, passed=True,
                      token_counts=[s["T"] for s in slots])
    finally:
        world.close()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_flashinfer_entry_on_emulated_world(quant, seed_for):
    """FlashInfer's argument list, outputs given, each rank on its own stream: outputs written in
    place and inside the precision contract, bit-identical across ranks."""
    ref = _reference()
    rnd = random.Random(seed_for("plan"))
    W, H, dtype = 2, 4096, torch.bfloat16
    world = dispatch.EmulatedWorld(W, 512, H, dtype, timeout_s=30.0)
    try:
        streams = [torch.cuda.Stream() for _ in range(W)]
        for i, T in enumerate([1, rnd.randint(2, 64), rnd.randint(257, 512)]):
            case = ref.make_case(W, T, H, 8, dtype, seed=seed_for(f"case{i}"), device="cuda", scale_kind="fp32",
                                 shared=i % 2 == 0, rsf=ref.f32(2.5), weight_bias=i % 2)
            provided = ref.alloc_outputs(case, quant)
            gs = ref.f32(ref.typical_global_scale(ref.reference_for(case)["norm_out"])) if quant else None
            gs_t = torch.tensor([gs if quant else 1.0], dtype=torch.float32, device="cuda")
            # world.run first: every rank's launcher is built before any rank's kernel waits for a peer
            world.run([dict(kw, quant=quant, global_scale=gs_t if quant else None) for kw in case])
            cur = torch.cuda.current_stream()
            outs = []
            for r, (kw, p, s) in enumerate(zip(case, provided, streams)):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    outs.append(trtllm_moe_finalize_allreduce_fusion(
                        kw["allreduce_in"], kw["residual_in"], kw["norm_weight"], kw["expanded_idx_to_permuted_idx"],
                        p["norm_out"], p["residual_out"], p.get("quant_out"), p.get("scale_out"),
                        world.workspaces[r], False, r, W, kw["eps"], kw["shared_expert_output"],
                        kw["expert_scale_factor"], kw["routed_scaling_factor"], float(kw["weight_bias"]),
                        global_scale=gs_t if quant else None))
            for s in streams:
                cur.wait_stream(s)
            torch.cuda.synchronize()
            world.check()
            ref.check_outputs(case, outs, provided, quant=quant, global_scale=gs, nvfp4_device="cuda",
                              label=f"flashinfer entry T={T}")
    finally:
        world.close()


# ---- the integration example's CPU parts ----------------------------------------------------------

def _load_example():
    """examples/moe_tail.py as a module (examples/ is a folder of scripts, not a package)."""
    import importlib.util
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "moe_tail.py"
    spec = importlib.util.spec_from_file_location("moe_tail_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_inputs_and_unfused_baseline_on_cpu(tmp_path):
    """examples/moe_tail.py imports without a GPU; its routing is a permutation grouped by
    expert; its unfused torch baseline (gloo, world size 1) agrees with the precision contract's
    result within the tolerance the example applies to the fused op."""
    import torch.distributed as dist
    ex = _load_example()
    args = ex.parse_args(["--tokens", "3,64", "--hidden", "512", "--top-k", "4", "--experts", "16"])
    assert args.token_counts == [3, 64]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for T in args.token_counts:
            x = ex.make_inputs(args, T, 0, torch.device("cpu"), torch.bfloat16)
            idx = x["expanded_idx_to_permuted_idx"]
            assert idx.dtype == torch.int32 and tuple(idx.shape) == (T, 4)
            assert torch.equal(idx.reshape(-1).sort().values, torch.arange(T * 4, dtype=torch.int32))
            assert torch.allclose(x["expert_scale_factor"].sum(-1), torch.ones(T))
            other = ex.make_inputs(args, T, 1, torch.device("cpu"), torch.bfloat16)
            assert torch.equal(other["residual_in"], x["residual_in"]) and torch.equal(other["expanded_idx_to_permuted_idx"], idx)
            assert not torch.equal(other["allreduce_in"], x["allreduce_in"])
            norm, res = ex.unfused_tail(x, dist.group.WORLD)
            want = _reference().reference([x], ex.EPS, 0, ex.ROUTED_SCALING_FACTOR, torch.bfloat16)
            want_res, want_norm = want["residual_out"], want["norm_out"]
            tol = ex.TOLERANCE_U * _reference().UNIT_ROUNDOFF[torch.bfloat16]
            assert ex.rel_err(res, want_res) <= tol and ex.rel_err(norm, want_norm) <= tol
            assert ex.rel_err(res, want_res) > 0  # per-op rounding: not the contract's bits
            assert ex.worst_over_ranks([0.5, float("nan")], torch.device("cpu")) == [0.5, math.inf]
    finally:
        dist.destroy_process_group()
