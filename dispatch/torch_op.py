"""The operation as a torch custom op, ``torch.ops.moe_ar.moe_finalize_allreduce``, for engines that
compile their model with ``torch.compile`` and capture it in CUDA graphs.

    h = dispatch.workspace_handle(ws)                 # once, outside the compiled code
    norm_out, residual_out, quant_out, scale_out = torch.ops.moe_ar.moe_finalize_allreduce(
        h, allreduce_in, expanded_idx_to_permuted_idx, residual_in, norm_weight,
        expert_scale_factor=scale, shared_expert_output=shared, eps=1e-6)

or, with keyword arguments and a MoeFinalizeOutputs result (None for the NVFP4 outputs when
quant is None):

    out = dispatch.moe_finalize_allreduce_op(h, allreduce_in=..., expanded_idx_to_permuted_idx=...,
                                             residual_in=..., norm_weight=..., ...)

Design:

* A workspace is a Python object and cannot be an operator argument. `workspace_handle(ws)`
  gives it an int handle (the same one every time; handles are never reused in a process) and
  the op takes that int. The registry holds workspaces weakly: it does not keep one alive.
* The op is functional: it allocates and returns new tensors, (norm_out [T, H] D,
  residual_out [T, H] D, quant_out, scale_out). With quant="nvfp4", quant_out is [T, H/2]
  uint8 and scale_out is 1-D uint8 of scale_out_bytes(T, H) (128x4 swizzled E4M3); with
  "fp8_group128", quant_out is [T, H] float8_e4m3fn and scale_out float32 of
  fp8_scale_shape(T, H, fp8_scale_layout); with "fp8_tensor", quant_out is [T, H]
  float8_e4m3fn and scale_out an empty float32 (0,); with quant=None both are empty uint8
  tensors of shape (0,) on the same device, in the real and in the fake implementation alike.
* It mutates none of its tensor arguments, but it is a collective with state outside torch's
  view (the workspace's buffers), so it is registered as an ordered side effect
  (torch.library's effect system): compiled graphs keep every call, in program order, even when
  its outputs are unused. Every rank must run the same sequence of calls (see
  op.moe_finalize_allreduce).
* The fake (meta) implementation derives the outputs from the inputs' metadata (T from
  expanded_idx_to_permuted_idx, H, dtype and device from residual_in) and checks argument
  dtypes and ranks, raising ValueError naming the argument. When the handle is a concrete int
  whose workspace is registered it also checks hidden, dtype and device against that workspace;
  a symbolic handle (torch.compile(dynamic=True) turns int inputs into SymInts) is not
  specialized, so one compiled graph serves every rank of an emulated world.
* The real implementation calls dispatch.moe_finalize_allreduce (outputs from torch's caching
  allocator on the current stream, so a CUDA-graph capture takes them from its private pool).
  Before capturing, run each shape once eagerly, so that programs are compiled and loaded and
  the workspace's launch state is built outside the capture.
* No autograd formula: the op is for inference. Autograd falls through it (its outputs do not
  require grad, whatever its inputs do): no gradient flows back through it, rather than a wrong one.
* Registered with torch.library.Library (schema, CUDA and CPU kernels, the fake), not
  torch.library.custom_op, whose Python wrapper costs more host time per eager call than the
  launch. The CPU kernel is the same function: the runtime refuses CPU tensors by name.
* ``torch.ops.moe_ar.moe_finalize_allreduce_out`` takes the outputs as arguments it writes
  (``Tensor(a!)`` .. ``Tensor(d!)``) and allocates nothing, for eager code and CUDA-graph capture.
  torch.compile refuses it (its fake raises): torch's ordered effects do not cover an op that
  mutates, and a compiled graph dropped a call whose outputs were unused, which for a collective
  is a hang on the other ranks. Compiled code uses the functional op.
"""
from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from string import Template
from typing import Optional

import torch

from . import call_arguments
from .call_arguments import ARGUMENTS, FP8_SCALE_LAYOUTS, MAX_TOP_K, check_unused, profile_for_quant
from .outputs import FP8_GROUP, QUANT_OUTPUTS, MoeFinalizeOutputs

OP_NAME = "moe_ar::moe_finalize_allreduce"
_HANDLE_ATTR = "_moe_ar_op_handle"
_WORKSPACE_ATTRS = ("hidden", "dtype", "device", "max_tokens", "world_size", "rank")

_registry: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
# Handles start at 2: torch.compile specializes the ints 0 and 1 even when it treats ints as
# dynamic, and one graph should serve every rank's handle.
_next_handle = itertools.count(2)
_registry_lock = threading.Lock()


# ---- workspace handles ----------------------------------------------------------------------

def workspace_handle(workspace) -> int:
    """The int handle of a workspace for the custom op (assigned at the first call, then the same).

    `workspace`: a dispatch.Workspace or LocalWorkspace, or one rank of an EmulatedWorld (`world.workspaces[r]`).
    Raises ValueError for anything else (an EmulatedWorld itself holds one workspace per rank).
    """
    handle = getattr(workspace, _HANDLE_ATTR, None)
    if handle is not None and _registry.get(handle) is workspace:
        return handle
    if type(workspace).__name__ == "EmulatedWorld":
        raise ValueError("workspace: an EmulatedWorld holds one workspace per rank; pass world.workspaces[r]")
    missing = [a for a in _WORKSPACE_ATTRS if not hasattr(workspace, a)]
    if missing:
        raise ValueError(f"workspace: expected a dispatch.Workspace (or an EmulatedWorld rank), got "
                         f"{type(workspace).__name__} without {', '.join(missing)}")
    with _registry_lock:
        handle = next(_next_handle)
        _registry[handle] = workspace
        setattr(workspace, _HANDLE_ATTR, handle)
    return handle


def workspace_from_handle(handle: int):
    """The live workspace registered under `handle`; ValueError if there is none."""
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise ValueError(f"workspace: expected an int handle from dispatch.workspace_handle, got "
                         f"{type(handle).__name__}")
    ws = _registry.get(handle)
    if ws is None:
        raise ValueError(f"workspace: no live workspace has handle {handle} (handles come from "
                         f"dispatch.workspace_handle(ws) in this process, and die with their workspace)")
    return ws


def as_handle(workspace) -> int:
    if isinstance(workspace, (int, torch.SymInt)) and not isinstance(workspace, bool):
        return workspace
    handle = getattr(workspace, _HANDLE_ATTR, None)  # a plain attribute read: no graph break under dynamo
    return handle if handle is not None else workspace_handle(workspace)


# ---- the op ---------------------------------------------------------------------------------

# Everything below is written from call_arguments.ARGUMENTS: the two schemas, the kernels and the keyword
# wrapper (as Python source, compiled once at import, so that a call does what a hand-written one does),
# and the fake's binding of its arguments.

def _required(arg) -> bool:
    return arg.default is inspect.Parameter.empty


def _schema_order(arguments) -> list:
    """The op's options in its schema's order: those published with it first, then those appended since
    (a positional caller keeps its positions), each in the description's order."""
    options = [arg for arg in arguments if not arg.output and not _required(arg)]
    return [arg for arg in options if not arg.appended] + [arg for arg in options if arg.appended]


def _schema_default(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def schemas(arguments) -> tuple:
    """(functional, out): the two ops' schemas (without the namespace). The out op takes the outputs after
    the inputs, each written (a!, b!, ...): those every call writes required, the quant's optional."""
    inputs = ["SymInt workspace", *(f"{arg.schema} {arg.name}" for arg in arguments if _required(arg))]
    options = [f"{arg.schema} {arg.name}={_schema_default(arg.default)}" for arg in _schema_order(arguments)]
    outputs = [arg for arg in arguments if arg.output]
    written = [f"Tensor({letter}!) {arg.name}" if arg.quants is None else f"Tensor({letter}!)? {arg.name}=None"
               for letter, arg in zip("abcdefghijklmnop", outputs)]
    returns = ", ".join(["Tensor"] * len(outputs))
    return (f"moe_finalize_allreduce({', '.join(inputs + options)}) -> ({returns})",
            f"moe_finalize_allreduce_out({', '.join(inputs + written + options)}) -> ()")


# Registered through torch.library.Library (schema, a CUDA kernel, a fake kernel) rather than
# torch.library.custom_op: the same operator for the dispatcher and torch.compile, at a fraction
# of the host time per eager call (custom_op's Python wrapper costs more than the launch).
_lib = torch.library.Library("moe_ar", "DEF")
for _schema in schemas(ARGUMENTS):
    _lib.define(_schema)
_KERNEL_KEYS = ("CUDA", "CPU")  # CPU: the runtime refuses CPU tensors by name (and CPU tests stub it)

# The dispatcher calls a kernel with the schema's arguments in order, positional, trailing defaults left
# out; each kernel passes them on to dispatch.moe_finalize_allreduce by name.
_KERNEL = Template("""
def _moe_finalize_allreduce(workspace, $parameters):
    from .op import moe_finalize_allreduce
    out = moe_finalize_allreduce(workspace_from_handle(workspace), $forward)
    device = out.norm_out.device
    quant_out, scale_out = out.quant_out, out.scale_out
    if quant_out is None:  # the op returns four tensors: an empty one of the dtype QUANT_OUTPUTS gives
        quant_out = torch.empty((0,), dtype=QUANT_OUTPUTS[quant][0][0], device=device)
    if scale_out is None:
        scale_out = torch.empty((0,), dtype=QUANT_OUTPUTS[quant][1][0], device=device)
    return out.norm_out, out.residual_out, quant_out, scale_out
""")
_OUT_KERNEL = Template("""
def _moe_finalize_allreduce_out(workspace, $parameters):
    from .op import moe_finalize_allreduce
    # every output the quant writes must be given: one left None would be allocated and dropped
$required
    kw = {}  # the quant's outputs only when given (the runtime names one given with a quant that writes none)
$given
    moe_finalize_allreduce(workspace_from_handle(workspace), $forward, **kw)
""")
_REQUIRED_OUTPUT = Template("""\
    if $name is None and quant in $quants:
        raise ValueError(f"$name: required by moe_finalize_allreduce_out with quant={quant!r}")""")
_GIVEN_OUTPUT = Template("""\
    if $name is not None:
        kw["$name"] = $name""")
_WRAPPER = Template("""
def moe_finalize_allreduce_op(workspace, *, $parameters) -> MoeFinalizeOutputs:
    # The op's schema converts; a bool, a string or a NaN must be refused here, not converted.
$checks
    norm_out, residual_out, quant_out, scale_out = moe_finalize_allreduce_custom_op(as_handle(workspace), $passed)
    if quant is None:
        return MoeFinalizeOutputs(norm_out, residual_out, None, None)
    return MoeFinalizeOutputs(norm_out, residual_out, quant_out, scale_out if quant in $scale_writers else None)
""")
_CONVERT = {"float": "float", "SymInt": "int", "bool": "bool"}  # the wrapper passes the schema's own types
_WRAPPER_DOC = """dispatch.moe_finalize_allreduce through the custom op (compiles without a graph break).

    `workspace`: an int handle from workspace_handle(ws), or the workspace itself (its handle is
    read from an attribute; under torch.compile pass a workspace that already has a handle, or
    the int). Other arguments as dispatch.moe_finalize_allreduce, except that outputs are always
    new tensors (no norm_out= etc.). Returns MoeFinalizeOutputs; quant_out and scale_out are
    None when quant is None, scale_out is None for quant="fp8_tensor".
    """


def define_calls(arguments, namespace: dict) -> tuple:
    """Compile the functional op's kernel, the out op's kernel and the keyword wrapper for `arguments`
    into `namespace` (this module's globals); returns the three."""
    parameter = call_arguments.parameter
    inputs = [arg for arg in arguments if _required(arg)]
    options = _schema_order(arguments)
    outputs = [arg for arg in arguments if arg.output]
    every_call = [arg for arg in outputs if arg.quants is None]  # the out op requires them
    per_quant = [arg for arg in outputs if arg.quants is not None]

    def names(args):
        return ", ".join(f"{arg.name}={arg.name}" for arg in args)

    kernel = call_arguments.define(_KERNEL.substitute(
        parameters=", ".join(parameter(arg) for arg in inputs + options), forward=names(inputs + options)),
        namespace, "_moe_finalize_allreduce")
    out_kernel = call_arguments.define(_OUT_KERNEL.substitute(
        parameters=", ".join([parameter(arg, default=False) for arg in inputs + every_call]
                             + [parameter(arg) for arg in per_quant + options]),
        required="\n".join(_REQUIRED_OUTPUT.substitute(name=arg.name, quants=repr(arg.quants)) for arg in per_quant),
        given="\n".join(_GIVEN_OUTPUT.substitute(name=arg.name) for arg in per_quant),
        forward=names(inputs + every_call + options)), namespace, "_moe_finalize_allreduce_out")
    scale_writers = next(arg.quants for arg in outputs if arg.name == "scale_out")
    wrapper = call_arguments.define(_WRAPPER.substitute(
        parameters=", ".join(parameter(arg, annotate=True) for arg in arguments if not arg.output),
        checks=call_arguments.checks(options, namespace),
        passed=", ".join(f"{_CONVERT[arg.schema]}({arg.name})" if arg.schema in _CONVERT else arg.name
                         for arg in inputs + options),
        scale_writers=repr(scale_writers)), namespace, "moe_finalize_allreduce_op")
    wrapper.__doc__ = _WRAPPER_DOC
    return kernel, out_kernel, wrapper


# help() and inspect show their parameters (a static analyzer sees only the names)
_moe_finalize_allreduce, _moe_finalize_allreduce_out, moe_finalize_allreduce_op = define_calls(ARGUMENTS, globals())

for _name, _kernel in (("moe_finalize_allreduce", _moe_finalize_allreduce),
                      ("moe_finalize_allreduce_out", _moe_finalize_allreduce_out)):
    for _key in _KERNEL_KEYS:
        _lib.impl(_name, _kernel, _key)
    # Not differentiable: autograd passes through, and outputs never require grad (without this,
    # torch's fallback gives them a grad_fn whose backward only warns and passes no gradient).
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")


def _meta_tensor(name, x, dtypes, ndim, device):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {x.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: {x.dim()} dimensions {tuple(x.shape)}, expected {ndim}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: on {x.device}, expected {device} (the device of residual_in)")
    return x


def _check_shape(name, x, shape):
    for got, want in zip(x.shape, shape):
        torch._check_with(ValueError, got == want,
                          lambda: f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}")


# The functional op's arguments as its kernel takes them (the fake binds its arguments by it)
_FUNCTIONAL_SIGNATURE = inspect.signature(_moe_finalize_allreduce)


@torch.library.register_fake(OP_NAME, lib=_lib)
def _moe_finalize_allreduce_fake(*args, **kwargs):
    bound = _FUNCTIONAL_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    workspace, quant = a["workspace"], a["quant"]
    residual = _meta_tensor("residual_in", a["residual_in"], (torch.float16, torch.bfloat16), 2, None)
    dtype, device = residual.dtype, residual.device
    T, H = residual.shape
    if isinstance(workspace, int) and not isinstance(workspace, bool):
        ws = workspace_from_handle(workspace)
        if ws.dtype != dtype:
            raise ValueError(f"residual_in: dtype {dtype}, the workspace was made for {ws.dtype}")
        if ws.device != device:
            raise ValueError(f"residual_in: on {device}, expected the workspace's device {ws.device}")
        if isinstance(H, int) and H != ws.hidden:
            raise ValueError(f"residual_in: hidden {H}, the workspace was made for hidden {ws.hidden}")
    idx = _meta_tensor("expanded_idx_to_permuted_idx", a["expanded_idx_to_permuted_idx"], (torch.int32,), 2, device)
    torch._check_with(ValueError, idx.shape[0] == T,
                      lambda: f"expanded_idx_to_permuted_idx: {idx.shape[0]} tokens, residual_in has {T}")
    K = idx.shape[1]
    if isinstance(K, int) and not 1 <= K <= MAX_TOP_K:
        raise ValueError(f"expanded_idx_to_permuted_idx: top_k {K} out of range 1..{MAX_TOP_K}")
    routed = _meta_tensor("allreduce_in", a["allreduce_in"], (dtype,), 2, device)
    torch._check_with(ValueError, routed.shape[1] == H,
                      lambda: f"allreduce_in: hidden {routed.shape[1]}, residual_in has hidden {H}")
    torch._check_with(ValueError, routed.shape[0] >= T * K,
                      lambda: f"allreduce_in: {routed.shape[0]} rows, fewer than tokens * top_k = {T} * {K}")
    _check_shape("norm_weight", _meta_tensor("norm_weight", a["norm_weight"], (dtype,), 1, device), (H,))
    if a["expert_scale_factor"] is not None:
        scale = _meta_tensor("expert_scale_factor", a["expert_scale_factor"], (dtype, torch.float32), 2, device)
        _check_shape("expert_scale_factor", scale, (T, K))
    if a["shared_expert_output"] is not None:
        _check_shape("shared_expert_output",
                     _meta_tensor("shared_expert_output", a["shared_expert_output"], (dtype,), 2, device), (T, H))
    profile_for_quant(quant)  # ValueError naming quant unless the manifest has a profile for it
    if a["weight_bias"] not in (0, 1):
        raise ValueError(f"weight_bias: {a['weight_bias']!r}, expected 0 or 1")
    check_unused(quant, a)
    layout = a["fp8_scale_layout"]
    if quant == "nvfp4":
        if a["global_scale"] is None:
            raise ValueError("global_scale: required for quant='nvfp4' (a [1] float32 device tensor)")
        _check_shape("global_scale", _meta_tensor("global_scale", a["global_scale"], (torch.float32,), 1, device),
                     (1,))
    elif quant in ("fp8_group128", "fp8_tensor"):
        if layout not in FP8_SCALE_LAYOUTS:
            raise ValueError(f"fp8_scale_layout: {layout!r}, expected 'row' or 'column'")
        if quant == "fp8_tensor":
            if a["fp8_scale"] is None:
                raise ValueError("fp8_scale: required for quant='fp8_tensor' (a [1] float32 device tensor)")
            _check_shape("fp8_scale", _meta_tensor("fp8_scale", a["fp8_scale"], (torch.float32,), 1, device), (1,))
        else:
            torch._check_with(ValueError, H % FP8_GROUP == 0,
                              lambda: f"quant: 'fp8_group128' needs hidden to be a multiple of {FP8_GROUP}, got {H}")
    quant_outputs = [residual.new_empty(shape(T, H, layout) if shape is not None else (0,), dtype=dtype)
                     for dtype, shape in QUANT_OUTPUTS[quant]]
    return (residual.new_empty((T, H)), residual.new_empty((T, H)), *quant_outputs)


_moe_finalize_allreduce_fake.__signature__ = _FUNCTIONAL_SIGNATURE


@torch.library.register_fake(OP_NAME + "_out", lib=_lib)
def _moe_finalize_allreduce_out_fake(*args, **kwargs):
    # A collective that writes into its arguments could be dropped or reordered by a compiled
    # graph (torch's ordered effects do not cover ops that mutate): refused where it is traced.
    raise ValueError("moe_finalize_allreduce_out: for eager calls and CUDA-graph capture; under torch.compile "
                     "use torch.ops.moe_ar.moe_finalize_allreduce (functional, an ordered side effect)")


def _register_effect(qualname: str) -> bool:
    """Mark an op as an ordered side effect (kept and ordered by compiled graphs). Returns whether
    this torch offers the effect system; older ones fall back to FX's side-effect set."""
    overload = getattr(torch.ops.moe_ar, qualname.split("::")[1]).default
    try:
        from torch._library.effects import EffectType
        _lib._register_effectful_op(overload, EffectType.ORDERED)
        return True
    except Exception:  # noqa: BLE001 - a private API: any torch where it differs takes the next way
        pass
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
        _register_effectful_op(overload, _EffectType.ORDERED)
        return True
    except Exception:  # noqa: BLE001
        torch.fx.node.has_side_effect(overload)
        return False


EFFECT_REGISTERED = _register_effect(OP_NAME)

moe_finalize_allreduce_custom_op = torch.ops.moe_ar.moe_finalize_allreduce
moe_finalize_allreduce_out_custom_op = torch.ops.moe_ar.moe_finalize_allreduce_out
