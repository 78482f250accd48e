"""The call's arguments are described once (dispatch/call_arguments.py, ARGUMENTS); the torch op's
schema, its CUDA and out kernels, its fake, its keyword wrapper and the FlashInfer entry are derived
from that description. These tests hold each of them to it, and show that an argument added to the
description reaches every one of them."""
from __future__ import annotations

import inspect

import pytest
import torch

import dispatch
from dispatch import call_arguments, flashinfer_compat, op, torch_op
from dispatch.call_arguments import ARGUMENTS, CALL_DEFAULTS, REQUIRED, Argument, check_scalar
from dispatch.outputs import MoeFinalizeOutputs, QUANT_OUTPUTS

OUTPUTS = tuple(arg.name for arg in ARGUMENTS if arg.output)
OPTIONS = tuple(arg.name for arg in ARGUMENTS if not arg.output and arg.name not in REQUIRED)

# The op's schema as published (dispatch/API.md): a positional caller relies on these positions, so an
# argument added later goes after them.
PUBLISHED = ("workspace", "allreduce_in", "expanded_idx_to_permuted_idx", "residual_in", "norm_weight",
             "expert_scale_factor", "routed_scaling_factor", "shared_expert_output", "eps", "weight_bias", "quant",
             "global_scale", "launch_with_pdl", "program", "fp8_scale", "fp8_scale_layout", "fp8_pow2_scales")


class _Workspace:
    device, hidden, dtype, max_tokens, world_size, rank = torch.device("meta"), 256, torch.bfloat16, 64, 2, 0


_KEEP = []


def _handle() -> int:
    _KEEP.append(_Workspace())
    return dispatch.workspace_handle(_KEEP[-1])


def _schema_arguments(overload):
    return overload.default._schema.arguments


def test_the_description_is_the_call_s_arguments():
    assert REQUIRED == tuple(a.name for a in ARGUMENTS if a.default is inspect.Parameter.empty)
    assert CALL_DEFAULTS == {a.name: a.default for a in ARGUMENTS if a.default is not inspect.Parameter.empty}
    assert len({a.name for a in ARGUMENTS}) == len(ARGUMENTS)
    assert OUTPUTS == ("norm_out", "residual_out", "quant_out", "scale_out")
    # the outputs' profiles are what outputs.QUANT_OUTPUTS allocates
    by_name = {a.name: a for a in ARGUMENTS}
    for i, name in enumerate(("quant_out", "scale_out")):
        assert by_name[name].quants == tuple(q for q, outs in QUANT_OUTPUTS.items() if outs[i][1] is not None)


def test_the_schemas_list_exactly_the_description():
    """Both ops' schemas: the workspace, then the description's inputs, (the out op: its outputs,) then
    every option with the description's type and default; the published positions are kept."""
    functional = _schema_arguments(torch.ops.moe_ar.moe_finalize_allreduce)
    out = _schema_arguments(torch.ops.moe_ar.moe_finalize_allreduce_out)
    names = [a.name for a in functional]
    assert names[: len(PUBLISHED)] == list(PUBLISHED)
    assert sorted(names) == sorted(("workspace", *REQUIRED, *OPTIONS))
    out_names = [a.name for a in out]
    assert out_names == names[:5] + list(OUTPUTS) + names[5:]
    by_name = {a.name: a for a in ARGUMENTS}
    for arg in (*functional, *out):
        if arg.name == "workspace":
            continue
        described = by_name[arg.name]
        if described.default is inspect.Parameter.empty or arg.name in ("norm_out", "residual_out"):
            assert not arg.has_default_value(), arg.name
        else:
            assert arg.default_value == described.default, arg.name
    assert [str(a.type) for a in functional[5:]] == [
        {"Tensor?": "Optional[Tensor]", "str?": "Optional[str]", "SymInt": "int"}.get(by_name[n].schema,
                                                                                         by_name[n].schema)
        for n in names[5:]]
    assert len(torch.ops.moe_ar.moe_finalize_allreduce.default._schema.returns) == len(OUTPUTS)
    assert [a.alias_info.is_write for a in out if a.name in OUTPUTS] == [True] * len(OUTPUTS)
    # each kernel takes its schema's arguments, in order, with its defaults
    for kernel, schema in ((torch_op._moe_finalize_allreduce, functional), (torch_op._moe_finalize_allreduce_out, out)):
        params = inspect.signature(kernel).parameters.values()
        assert [(p.name, p.default is not p.empty) for p in params] == [(a.name, a.has_default_value()) for a in schema]
        assert all(p.default == a.default_value for p, a in zip(params, schema) if a.has_default_value())


def _values(with_outputs: bool) -> dict:
    """A distinct value for every argument of the description (scalars the wrapper's checks accept)."""
    values = {a.name: object() for a in ARGUMENTS if a.schema.startswith("Tensor")}
    values.update(routed_scaling_factor=1.5, eps=1e-3, weight_bias=1, quant="fp8_group128", fp8_scale_layout="column",
                  fp8_pow2_scales=True, launch_with_pdl=True, program="moe_ar_x")
    assert set(values) == {a.name for a in ARGUMENTS}
    return values if with_outputs else {n: v for n, v in values.items() if n not in OUTPUTS}


def _recorded(monkeypatch):
    seen = []

    def runtime(ws, **kwargs):
        seen.append((ws, kwargs))
        t = torch.empty(0)
        return MoeFinalizeOutputs(t, t, t, t)

    monkeypatch.setattr(op, "moe_finalize_allreduce", runtime)
    return seen


def test_the_kernels_pass_every_argument_on(monkeypatch):
    """The functional op's kernel and the out op's kernel, called as the dispatcher calls them (every
    argument positional, in schema order), give the runtime every argument under its own name."""
    seen = _recorded(monkeypatch)
    h = _handle()
    values = _values(with_outputs=False)
    order = [a.name for a in _schema_arguments(torch.ops.moe_ar.moe_finalize_allreduce)][1:]
    torch_op._moe_finalize_allreduce(h, *(values[n] for n in order))
    ws, kwargs = seen[-1]
    assert ws is dispatch.workspace_from_handle(h)
    assert kwargs.keys() == values.keys() and all(kwargs[n] is values[n] for n in values)
    values = _values(with_outputs=True)
    order = [a.name for a in _schema_arguments(torch.ops.moe_ar.moe_finalize_allreduce_out)][1:]
    torch_op._moe_finalize_allreduce_out(h, *(values[n] for n in order))
    kwargs = seen[-1][1]
    assert kwargs.keys() == values.keys() and all(kwargs[n] is values[n] for n in values)
    # trailing arguments left at their defaults (the dispatcher drops them) arrive with the defaults
    torch_op._moe_finalize_allreduce(h, *(values[n] for n in REQUIRED))
    assert seen[-1][1] == {**{n: values[n] for n in REQUIRED}, **{n: CALL_DEFAULTS[n] for n in OPTIONS}}


def test_the_keyword_wrapper_passes_every_argument_to_the_op(monkeypatch):
    seen = []
    monkeypatch.setattr(torch_op, "moe_finalize_allreduce_custom_op",
                        lambda *args: seen.append(args) or (None, None, None, None))
    h = _handle()
    values = _values(with_outputs=False)
    dispatch.moe_finalize_allreduce_op(h, **values)
    order = [a.name for a in _schema_arguments(torch.ops.moe_ar.moe_finalize_allreduce)]
    assert list(seen[-1]) == [h] + [values[n] for n in order[1:]]
    signature = inspect.signature(dispatch.moe_finalize_allreduce_op)
    assert list(signature.parameters)[0] == "workspace"
    assert {n: p.default for n, p in list(signature.parameters.items())[1:]} == {
        **dict.fromkeys(REQUIRED, inspect.Parameter.empty), **{n: CALL_DEFAULTS[n] for n in OPTIONS}}
    assert all(p.kind is p.KEYWORD_ONLY for p in list(signature.parameters.values())[1:])


def test_the_fake_takes_what_the_schema_takes():
    """The fake binds its arguments by the schema (positional, keywords, trailing defaults dropped)."""
    h = _handle()
    kw = dict(allreduce_in=torch.empty(8, 256, dtype=torch.bfloat16, device="meta"),
              expanded_idx_to_permuted_idx=torch.empty(4, 2, dtype=torch.int32, device="meta"),
              residual_in=torch.empty(4, 256, dtype=torch.bfloat16, device="meta"),
              norm_weight=torch.empty(256, dtype=torch.bfloat16, device="meta"))
    by_keyword = torch_op._moe_finalize_allreduce_fake(h, **kw, quant="fp8_group128", fp8_scale_layout="column")
    positional = [kw[n] for n in REQUIRED] + [CALL_DEFAULTS[n] for n in PUBLISHED[5:]]
    positional[PUBLISHED.index("quant") - 1] = "fp8_group128"
    positional[PUBLISHED.index("fp8_scale_layout") - 1] = "column"
    by_position = torch_op._moe_finalize_allreduce_fake(h, *positional)
    assert [tuple(t.shape) for t in by_keyword] == [tuple(t.shape) for t in by_position] == \
        [(4, 256), (4, 256), (4, 256), (2, 4)]
    with pytest.raises(TypeError):
        torch_op._moe_finalize_allreduce_fake(h, **kw, no_such_argument=1)


def test_an_argument_added_to_the_description_reaches_every_part():
    """Adding an argument is one entry in the description: the schemas, the kernels and the wrapper
    (built here into a scratch namespace, not registered) all take it and pass it on."""
    extended = ARGUMENTS + (Argument("new_knob", "float", 2.5, check=(check_scalar,), appended=True),)
    functional, out = torch_op.schemas(extended)
    assert functional.endswith("bool fp8_pow2_scales=False, float new_knob=2.5) -> (Tensor, Tensor, Tensor, Tensor)")
    assert out.endswith("float new_knob=2.5) -> ()") and "Tensor(d!)? scale_out=None" in out
    namespace = dict(vars(torch_op))
    torch_op.define_calls(extended, namespace)
    wrapper = namespace["moe_finalize_allreduce_op"]
    assert inspect.signature(wrapper).parameters["new_knob"].default == 2.5
    seen = []
    namespace["moe_finalize_allreduce_custom_op"] = lambda *args: seen.append(args) or (None,) * 4
    values = _values(with_outputs=False)
    wrapper(_handle(), **values, new_knob=3)
    assert seen[-1][-1] == 3.0 and type(seen[-1][-1]) is float
    with pytest.raises(ValueError, match="^new_knob: "):
        wrapper(_handle(), **values, new_knob=float("nan"))
    kernel_source = inspect.getsource(namespace["_moe_finalize_allreduce"])
    assert "new_knob=2.5" in kernel_source and "new_knob=new_knob" in kernel_source
    assert "new_knob=new_knob" in inspect.getsource(namespace["_moe_finalize_allreduce_out"])


def test_the_published_schema_text_is_api_md_s():
    """dispatch/API.md shows the functional op's schema: the text the description gives."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parent.parent / "dispatch" / "API.md").read_text()
    shown = re.search(r"    (moe_ar::moe_finalize_allreduce\(.*?-> \(.*?\))\n", text, re.S).group(1)
    assert " ".join(shown.split()) == "moe_ar::" + torch_op.schemas(ARGUMENTS)[0]


# ---- the FlashInfer entry --------------------------------------------------------------------------

# flashinfer.comm.trtllm_moe_finalize_allreduce_fusion (FlashInfer's source): its parameters, in order
FLASHINFER = ("allreduce_in", "residual_in", "norm_weight", "expanded_idx_to_permuted_idx", "norm_out", "residual_out",
              "quant_out", "scale_out", "workspace_ptrs", "launch_with_pdl", "world_rank", "world_size", "eps",
              "shared_expert_output", "expert_scale_factor", "routed_scaling_factor", "weight_bias")


def test_the_flashinfer_entry_shows_flashinfer_s_signature():
    signature = inspect.signature(dispatch.trtllm_moe_finalize_allreduce_fusion)
    params = list(signature.parameters.values())
    assert [p.name for p in params] == [*FLASHINFER, "backend", "global_scale"]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[: len(FLASHINFER)])
    assert [p.name for p in params if p.default is not p.empty] == ["weight_bias", "backend", "global_scale"]
    assert params[-3].default is None and params[-2].default == "trtllm" and params[-1].default is None
    assert [p.kind for p in params[-2:]] == [inspect.Parameter.KEYWORD_ONLY] * 2


def test_every_flashinfer_argument_named_as_ours_reaches_the_call(monkeypatch):
    """FlashInfer's arguments whose names are the description's are passed on under those names (some
    converted: eps to float, routed_scaling_factor None to 1.0, weight_bias to the int, quant_out and
    scale_out to uint8 views that make quant "nvfp4"); the others are the entry's own."""
    seen = []
    monkeypatch.setattr(flashinfer_compat, "moe_finalize_allreduce",
                        lambda ws, **kwargs: seen.append(kwargs) or MoeFinalizeOutputs(None, None, None, None))
    ws = _Workspace()
    ws.device = torch.device("cpu")
    T, H = 4, 256
    given = dict(allreduce_in=object(), residual_in=torch.empty(T, H), norm_weight=object(),
                 expanded_idx_to_permuted_idx=torch.empty(T, 2, dtype=torch.int32), norm_out=object(),
                 residual_out=object(), quant_out=torch.empty(T, H // 2, dtype=torch.uint8),
                 scale_out=torch.empty(dispatch.scale_out_bytes(T, H), dtype=torch.uint8), workspace_ptrs=ws,
                 launch_with_pdl=True, world_rank=0, world_size=2, eps=1e-3, shared_expert_output=object(),
                 expert_scale_factor=object(), routed_scaling_factor=None, weight_bias=1.0)
    gs = object()
    dispatch.trtllm_moe_finalize_allreduce_fusion(**given, global_scale=gs)
    kwargs = seen[-1]
    ours = {a.name for a in ARGUMENTS}
    assert set(kwargs) == {n for n in FLASHINFER if n in ours} | {"quant", "global_scale"}
    for name in set(kwargs) - {"quant_out", "scale_out", "routed_scaling_factor", "weight_bias", "quant", "eps",
                               "global_scale"}:
        assert kwargs[name] is given[name], name
    assert kwargs["global_scale"] is gs and kwargs["quant"] == "nvfp4"
    assert (kwargs["routed_scaling_factor"], kwargs["weight_bias"], kwargs["eps"]) == (1.0, 1, 1e-3)
    assert kwargs["quant_out"].data_ptr() == given["quant_out"].data_ptr()
    assert kwargs["scale_out"].data_ptr() == given["scale_out"].data_ptr()


def test_the_flashinfer_backend_names():
    """FlashInfer's finalize entry has no backend argument; its unified all-reduce fusion API names
    its backends "trtllm", "mnnvl" and "auto". This entry takes "trtllm" (the TensorRT-LLM kernel
    family it stands in for) and "auto"; any other name is refused by name."""
    assert flashinfer_compat.BACKENDS == ("trtllm", "auto")
