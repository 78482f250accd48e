"""The per-signature call plan (dispatch/call_plan.py, kept by dispatch/op.py) on the CPU: a call whose
signature was checked before takes the short path, and the short path accepts exactly what the full
checks accept.

Every bad call made AFTER a good call of the same signature (so that a plan exists) must raise the
same ValueError the full checks raise on a fresh workspace; a good call must reuse the plan.
"""
from __future__ import annotations

import ctypes
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch import call_plan, launcher, op
from dispatch.call_arguments import CALL_DEFAULTS
from dispatch.overlaps import _INPUT_NAMES, _OUTPUT_NAMES, overlap_pairs
from dispatch.workspace_state import WorkspaceState

H, T, K, MAX_T = 128, 5, 3, 16
D = torch.bfloat16


class _FakeLauncher:
    """What a plan reads from a launcher, without a GPU."""
    profile, regime = "nvfp4", "twoshot"

    def __init__(self, ws, name):
        self.name = name

    def kernel_call(self, ws, T, a, order):
        return None  # nothing to launch: the plan only checks


def _workspace():
    ws = types.SimpleNamespace(dtype=D, dtype_name="bf16", hidden=H, device=torch.device("cpu"), device_index=-1,
                               max_tokens=MAX_T, world_size=2, oneshot_max_tokens=MAX_T,
                               _moe_ar_state=WorkspaceState())
    ws._moe_ar_state.memory = types.SimpleNamespace(error=[0])  # no timeout recorded
    return ws


@pytest.fixture(autouse=True)
def fake_launcher(monkeypatch):
    monkeypatch.setattr(op, "launcher_for", lambda ws, name: _FakeLauncher(ws, name))
    monkeypatch.setattr(op, "select_program", lambda ws, T, quant, shared, top_k=None: "moe_ar_twoshot_bf16_ws2_nvfp4")


def _valid():
    R = T * K + 2
    arena = torch.empty(1 << 16, dtype=torch.uint8)  # every tensor its own 256-aligned slice of one buffer

    def take(n_bytes, dtype, shape, offset=[0]):
        start = offset[0]
        offset[0] = -(-(start + n_bytes) // 256) * 256
        return arena[start:start + n_bytes].view(dtype).view(shape)

    a = dict(allreduce_in=take(R * H * 2, D, (R, H)), expanded_idx_to_permuted_idx=take(T * K * 4, torch.int32, (T, K)),
             expert_scale_factor=take(T * K * 4, torch.float32, (T, K)),
             shared_expert_output=take(T * H * 2, D, (T, H)), residual_in=take(T * H * 2, D, (T, H)),
             norm_weight=take(H * 2, D, (H,)), eps=1e-6, quant="nvfp4", global_scale=take(4, torch.float32, (1,)),
             norm_out=take(T * H * 2, D, (T, H)), residual_out=take(T * H * 2, D, (T, H)),
             quant_out=take(T * H // 2, torch.uint8, (T, H // 2)),
             scale_out=take(op.scale_out_bytes(T, H), torch.uint8, (op.scale_out_bytes(T, H),)))
    a["expanded_idx_to_permuted_idx"].copy_(torch.randperm(R)[:T * K].view(T, K))
    return a


def test_a_repeated_signature_takes_the_short_path(full_checks):
    ws = _workspace()
    op.prepare_call(ws, _valid())
    assert full_checks[0] == 1 and len(ws._moe_ar_state.plans) == 1
    for _ in range(3):
        op.prepare_call(ws, _valid())  # new tensors, same dtypes and shapes
    assert full_checks[0] == 1
    a = _valid()
    a["eps"] = 1e-5  # another value: another signature
    op.prepare_call(ws, a)
    assert full_checks[0] == 2 and len(ws._moe_ar_state.plans) == 2


def test_the_last_plan_is_matched_before_any_signature(full_checks, monkeypatch):
    ws = _workspace()
    op.moe_finalize_allreduce(ws, **_valid())
    plan = ws._moe_ar_state.recent_plans[0]
    monkeypatch.setattr(op, "plan_signature", lambda *a: pytest.fail("looked up by signature"))
    for _ in range(3):
        out = op.moe_finalize_allreduce(ws, **_valid())
        assert ws._moe_ar_state.recent_plans == [plan] and out.quant_out is not None and out.scale_out is not None
    assert full_checks[0] == 1


def test_recent_plans_serve_alternating_signatures(full_checks, monkeypatch):
    """Up to _RECENT_PLANS signatures in turn are matched without building a signature; one more
    evicts the least recently used, which is then found by its signature (no new full checks)."""
    ws = _workspace()

    def call(eps):
        a = _valid()
        a["eps"] = eps
        op.moe_finalize_allreduce(ws, **a)

    epss = [1e-6 * (i + 1) for i in range(op._RECENT_PLANS + 1)]
    for eps in epss[:-1]:
        call(eps)
    assert full_checks[0] == op._RECENT_PLANS and len(ws._moe_ar_state.recent_plans) == op._RECENT_PLANS
    real_signature = op.plan_signature
    monkeypatch.setattr(op, "plan_signature", lambda *a: pytest.fail("looked up by signature"))
    for _ in range(3):
        for eps in epss[:-1]:
            call(eps)
    monkeypatch.setattr(op, "plan_signature", real_signature)
    call(epss[-1])  # a new signature: the least recent (epss[0]) leaves the recent plans
    assert full_checks[0] == op._RECENT_PLANS + 1 and len(ws._moe_ar_state.recent_plans) == op._RECENT_PLANS
    looked_up = []
    monkeypatch.setattr(op, "plan_signature", lambda *a: looked_up.append(1) or real_signature(*a))
    call(epss[0])
    assert looked_up == [1] and full_checks[0] == op._RECENT_PLANS + 1  # found by its signature


@pytest.mark.parametrize("quant", [None, "nvfp4", "fp8_group128", "fp8_tensor"])
@pytest.mark.parametrize("optional", [(), ("expert_scale_factor",), ("shared_expert_output",),
                                      ("expert_scale_factor", "shared_expert_output")])
def test_each_pointer_reaches_its_kernel_field(quant, optional):
    """The plan's packer writes the i-th pointer of its order to that argument's Params field and
    leaves every other pointer field 0 (the kernel reads a null pointer as "not given")."""
    from dispatch import registry
    a = dict(CALL_DEFAULTS, quant=quant, **{name: object() for name in optional})
    order = call_plan._pointer_order(a)
    params = registry.params_struct()()
    ctypes_fill = bytes(range(256)) * (ctypes.sizeof(params) // 256 + 1)
    ctypes.memmove(ctypes.addressof(params), ctypes_fill, ctypes.sizeof(params))  # every field non-zero first
    kernel = launcher._KernelCall(params, order, launcher._LaunchConfig(), 0)
    pointers = [0x10000 * (i + 1) + 0x40 for i in range(len(order))]
    kernel.packer.pack_into(params, type(params).allreduce_in.offset, *pointers)
    want = {launcher._FIELD_OF[name]: p for name, p in zip(order, pointers)}
    assert len(want) == len(order)
    for field in launcher._POINTER_FIELDS:
        assert (getattr(params, field) or 0) == want.get(field, 0), field
    base, end = type(params).allreduce_in.offset, type(params).allreduce_in.offset + 8 * len(launcher._POINTER_FIELDS)
    raw = ctypes.string_at(ctypes.addressof(params), ctypes.sizeof(params))
    assert raw[:base] == ctypes_fill[:base] and raw[end:] == ctypes_fill[end:ctypes.sizeof(params)]  # nothing else


def _outcome(ws, a, entry=op.prepare_call):
    try:
        if entry is op.prepare_call:
            op.prepare_call(ws, dict(a))
        else:
            op.moe_finalize_allreduce(ws, **a)
    except ValueError as e:
        return str(e)
    return None


def _expect_same_error(mutate, must_raise=True):
    """The mutated call has the same outcome (the same ValueError, or none) on a fresh workspace and
    after a good call of the same signature: through prepare_call (the plan looked up by signature)
    and through moe_finalize_allreduce (the workspace's last plan matched first)."""
    a = _valid()
    mutate(a)
    fresh = _outcome(_workspace(), a)
    if must_raise:
        assert fresh is not None, "the mutation should make a bad call"
    for entry in (op.prepare_call, op.moe_finalize_allreduce):
        ws = _workspace()
        _outcome(ws, _valid(), entry)
        assert ws._moe_ar_state.recent_plans
        assert _outcome(ws, a, entry) == fresh
        ws._moe_ar_state.recent_plans.clear()  # the plan found by its signature
        assert _outcome(ws, a, entry) == fresh


def _shift(name):
    """The same dtype and shape, 2 bytes further: misaligned for every tensor argument."""
    def mutate(a):
        x = a[name]
        raw = torch.empty(x.numel() * x.element_size() + 16, dtype=torch.uint8)
        a[name] = raw[2:2 + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
    return mutate


def _strided(name):
    def mutate(a):
        x = a[name]
        if x.dim() == 2 and x.shape[1] > 1:
            a[name] = torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype)[:, ::2]
        else:
            a[name] = torch.empty(*x.shape, 2, dtype=x.dtype)[..., 0]
    return mutate


def _over(output, other, offset_elems=0):
    def mutate(a):
        src = a[other]
        x = a[output]
        n = x.numel() * x.element_size()
        flat = src.view(torch.uint8).reshape(-1) if src.element_size() > 1 or src.dim() != 1 else src
        if flat.numel() < n + offset_elems:
            big = torch.empty(n + offset_elems + 256, dtype=torch.uint8)
            a[other] = big[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
            flat = big
        a[output] = flat[offset_elems:offset_elems + n].view(x.dtype).view(x.shape)
    return mutate


TENSORS = ("allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
           "residual_in", "norm_weight", "global_scale", "norm_out", "residual_out", "quant_out", "scale_out")


@pytest.mark.parametrize("name", TENSORS)
def test_misaligned_tensor_after_a_plan(name):
    if name in ("expanded_idx_to_permuted_idx", "expert_scale_factor", "global_scale", "scale_out", "quant_out"):
        pytest.skip("needs only 4-byte alignment; a 2-byte shift of a 4-byte type is the dtype's own view")
    _expect_same_error(_shift(name))


@pytest.mark.parametrize("name", [n for n in TENSORS if n not in ("norm_weight", "global_scale", "scale_out")])
def test_strided_tensor_after_a_plan(name):
    _expect_same_error(_strided(name))


@pytest.mark.parametrize("output", ("norm_out", "residual_out", "quant_out", "scale_out"))
@pytest.mark.parametrize("other", ("allreduce_in", "shared_expert_output", "residual_in", "norm_out", "residual_out"))
def test_overlap_after_a_plan(output, other):
    if output == other:
        return
    # residual_out exactly over residual_in is the allowed in-place call: shift it to a partial overlap
    shift = 256 if (output, other) == ("residual_out", "residual_in") else 0
    _expect_same_error(_over(output, other, shift))


def test_one_overlap_rule_pairs_every_output_with_everything_else_once():
    """overlap_pairs, which both the full checks and the plans use: each output with every other
    tensor of the call exactly once, in place allowed for residual_out over residual_in only, for
    tensor names in any order (the full checks list outputs first, a plan the kernel's order)."""
    everything = list(_INPUT_NAMES + _OUTPUT_NAMES)
    for names in (everything, everything[::-1], _OUTPUT_NAMES + _INPUT_NAMES,
                  ["allreduce_in", "residual_in", "norm_weight", "residual_out"]):
        names = list(names)
        pairs = overlap_pairs(names)
        unordered = [frozenset((names[i], names[j])) for i, j, _ in pairs]
        assert len(unordered) == len(set(unordered)), names
        assert set(unordered) == {frozenset((o, x)) for o in _OUTPUT_NAMES if o in names for x in names if x != o}
        assert all(names[i] in _OUTPUT_NAMES for i, _, _ in pairs)
        assert [(names[i], names[j]) for i, j, in_place in pairs if in_place] == [("residual_out", "residual_in")]


def test_in_place_residual_takes_the_short_path(full_checks):
    ws = _workspace()
    a = _valid()
    a["residual_out"] = a["residual_in"]
    op.prepare_call(ws, a)
    b = _valid()
    b["residual_out"] = b["residual_in"]
    op.prepare_call(ws, b)
    assert full_checks[0] == 1


@pytest.mark.parametrize("name, good, bad", [
    ("weight_bias", 1, True), ("weight_bias", 0, False), ("eps", 1e-6, float("nan")),
    ("routed_scaling_factor", 1.0, float("inf")), ("launch_with_pdl", False, 0), ("fp8_pow2_scales", False, 0),
])
def test_a_scalar_of_another_type_or_nan_is_not_taken_for_a_checked_one(name, good, bad):
    ws = _workspace()
    a = _valid()
    a[name] = good
    op.prepare_call(ws, a)
    b = _valid()
    b[name] = bad
    with pytest.raises(ValueError, match=f"^{name}:"):
        op.prepare_call(ws, b)


def test_an_unhashable_argument_is_named():
    ws = _workspace()
    op.prepare_call(ws, _valid())
    a = _valid()
    a["eps"] = [1e-6]
    with pytest.raises(ValueError, match="^eps:"):
        op.prepare_call(ws, a)


def test_outputs_not_given_are_allocated_on_the_short_path(full_checks):
    ws = _workspace()
    for _ in range(2):
        a = _valid()
        for name in ("norm_out", "residual_out", "quant_out", "scale_out"):
            del a[name]
        call = op.prepare_call(ws, a)
        assert call.outputs.norm_out.shape == (T, H) and call.outputs.scale_out.numel() == op.scale_out_bytes(T, H)
        order = call_plan._pointer_order(dict(CALL_DEFAULTS, **a))
        assert [a[name].data_ptr() for name in order] == call.pointers
    assert full_checks[0] == 1


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(op, "_PLANS_PER_WORKSPACE", 4)
    ws = _workspace()
    for i in range(10):
        a = _valid()
        a["eps"] = 1e-6 * (i + 1)
        op.prepare_call(ws, a)
        assert len(ws._moe_ar_state.plans) <= 4


def _cpu_launcher(launched):
    """A real launcher._Launcher's kernel_call without a GPU: one row split, no cluster; its launch
    records the kernel argument's fault_stop_after instead of launching."""
    from dispatch import registry
    lau = object.__new__(launcher._Launcher)
    lau.template = registry.params_struct()()
    lau.row_splits = (types.SimpleNamespace(threads=32, vec_per_thread=1, max_tokens=MAX_T),)
    lau.threads, lau.max_blocks, lau.dynamic_smem = [32], [8], 0
    lau.cluster_max_tokens, lau.function_ptr, lau.cluster_function_ptr, lau.shape_builds = 0, 0, 0, None
    lau.cluster_max_tokens_by_top_k = (0,) * 9
    lau.sliced_units = lau.column_units = False
    lau.profile, lau.regime = _FakeLauncher.profile, _FakeLauncher.regime
    lau.launch = lambda kernel, pointers: launched.append(kernel.params.fault_stop_after)
    return lau


def test_the_test_only_fault_setting_costs_a_call_nothing(full_checks, monkeypatch):
    """The workspace's fault injection (tests/test_gpu_reliability.py) goes into a plan's kernel
    argument when the plan is built; setting it drops the plans, so no call compares it."""
    launched = []
    lau = _cpu_launcher(launched)
    monkeypatch.setattr(op, "launcher_for", lambda ws, name: lau)
    ws = _workspace()
    state = ws._moe_ar_state
    op.moe_finalize_allreduce(ws, **_valid())
    assert full_checks[0] == 1 and state.plans and state.recent_plans
    state.fault_stop_after_units = 3
    assert not state.plans and not state.recent_plans
    op.moe_finalize_allreduce(ws, **_valid())
    op.moe_finalize_allreduce(ws, **_valid())  # the short path: the plan carries it
    state.fault_stop_after_units = 0
    op.moe_finalize_allreduce(ws, **_valid())
    assert launched == [0, 3, 3, 0] and full_checks[0] == 3
    for bad in (-1, 1.5, True, 2 ** 31, None):
        with pytest.raises(ValueError, match="^fault_stop_after_units: "):
            state.fault_stop_after_units = bad
    assert state.fault_stop_after_units == 0 and state.plans


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(TENSORS), how=st.sampled_from(("dtype", "shape", "not a tensor", "device-less")))
def test_any_bad_tensor_after_a_plan_is_named_as_without(name, how):
    def mutate(a):
        x = a[name]
        if how == "dtype":
            a[name] = x.to(torch.float64)
        elif how == "shape":
            a[name] = torch.cat([x, x[..., :1]], dim=-1) if x.dim() else x
        elif how == "not a tensor":
            a[name] = x.tolist()
        else:
            a[name] = torch.empty(x.shape, dtype=x.dtype, device="meta")
    _expect_same_error(mutate, must_raise=False)  # a longer scale_out is a good call


def test_the_pointer_order_writes_what_each_program_writes():
    """The outputs whose pointers a plan passes are the outputs each program's manifest entry says it
    writes, and the scale input it passes is its profile's (every program, every quant)."""
    from dispatch import registry
    quant_of = {profile: quant for quant, profile in registry.program_set().profile_of_quant.items()}
    for name in registry.programs():
        info = registry.program_info(name)
        order = call_plan._pointer_order(dict(CALL_DEFAULTS, quant=quant_of[info["profile"]]))
        assert [n for n in order if n in _OUTPUT_NAMES] == list(info["outputs"]), name
        scale_inputs = {n for n in order if n in ("global_scale", "fp8_scale")}
        assert scale_inputs == {"nvfp4": {"global_scale"}, "fp8_tensor": {"fp8_scale"}}.get(info["profile"], set())


# ---- the public signatures against the one description of the call's arguments ----------------

def _keywords(fn) -> dict:
    """{name: default (inspect.Parameter.empty where required)} of fn's keyword-only parameters."""
    import inspect
    return {name: p.default for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_the_call_shows_every_argument_with_its_default():
    """help(dispatch.moe_finalize_allreduce) and an IDE see every keyword and its default, and they
    are call_arguments' description (REQUIRED, then CALL_DEFAULTS)."""
    import inspect

    from dispatch import torch_op
    from dispatch.call_arguments import REQUIRED
    described = {**dict.fromkeys(REQUIRED, inspect.Parameter.empty), **CALL_DEFAULTS}
    assert _keywords(op.moe_finalize_allreduce) == described
    outputs = ("norm_out", "residual_out", "quant_out", "scale_out")  # the op always allocates them
    assert _keywords(torch_op.moe_finalize_allreduce_op) == {n: d for n, d in described.items() if n not in outputs}
    schema = {a.name: a.default_value for a in torch_op.moe_finalize_allreduce_custom_op.default._schema.arguments}
    for name, default in CALL_DEFAULTS.items():
        if name not in outputs:
            assert name in schema and schema[name] == default, (name, schema.get(name))


def test_every_keyword_reaches_the_call(monkeypatch):
    """Each keyword the signature shows arrives in the call's arguments as given; help() lists them
    with their defaults; an unknown keyword is a ValueError naming it."""
    import pydoc

    from dispatch.call_arguments import REQUIRED
    ws = _workspace()
    with pytest.raises(ValueError, match="^world_size: unknown argument"):
        op.moe_finalize_allreduce(ws, world_size=2, **_valid())
    seen = []
    monkeypatch.setattr(op, "prepare_call", lambda ws, kwargs: seen.append(kwargs) or types.SimpleNamespace(
        launch=lambda: None))
    given = {name: object() for name in [*REQUIRED, *CALL_DEFAULTS]}
    op.moe_finalize_allreduce(ws, **given)
    assert seen[0] == given and all(seen[0][name] is given[name] for name in given)
    shown = pydoc.render_doc(op.moe_finalize_allreduce, renderer=pydoc.plaintext)
    assert "norm_weight, expert_scale_factor=None, routed_scaling_factor=1.0," in shown, shown[:600]
    assert "fp8_scale_layout='row'" in shown and "launch_with_pdl=False, program=None)" in shown
