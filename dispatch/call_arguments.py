"""A call's arguments, checked in full (the first call of a signature): each tensor's type, dtype,
shape, device, contiguity and alignment, the scalars, the arguments a quant does not use, and the
overlap rule (overlaps.py). Every bad call is a ValueError naming the argument."""
from __future__ import annotations

import inspect
import itertools
import linecache
from dataclasses import dataclass

import torch

from . import registry
from .outputs import FP8_GROUP, QUANT_OUTPUT_NAMES, QUANT_OUTPUTS, MoeFinalizeOutputs, fp8_scale_shape, \
    scale_out_bytes
from .overlaps import check_overlaps

MAX_TOP_K = 16
FP8_SCALE_LAYOUTS = ("row", "column")


def profile_for_quant(quant) -> str:
    """The output profile `quant` asks for (from the manifest; no copy on the call path)."""
    profiles = registry.program_set().profile_of_quant
    if not isinstance(quant, (str, type(None))) or quant not in profiles:
        raise ValueError(f"quant: {quant!r}, expected one of {', '.join(repr(q) for q in profiles)}")
    return profiles[quant]


def _tensor(name, x, ws, dtypes, shape=None, ndim=None, align=16):
    """Check one tensor argument; returns (name, x, its data pointer) for the overlap check."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {x.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: {x.dim()} dimensions {tuple(x.shape)}, expected {ndim}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.device != ws.device:
        raise ValueError(f"{name}: on {x.device}, expected the workspace's device {ws.device}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    ptr = x.data_ptr()
    if ptr % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
    return name, x, ptr


# float32 rounding of a Python float: from _F32_INF up it gives inf; up to _F32_ZERO (positive), 0.
_F32_INF = 2.0 ** 128 - 2.0 ** 103
_F32_ZERO = 2.0 ** -150


def check_scalar(name, x, positive=False):
    """A Python float or int (not a bool) that stays finite as the kernel's float32, and > 0 there
    when `positive`."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name}: expected a Python float, got {type(x).__name__}")
    if not -_F32_INF < x < _F32_INF:  # NaN too
        raise ValueError(f"{name}: {x!r} is not finite as a float32 (the kernel takes it as one)")
    if positive and not x > _F32_ZERO:
        raise ValueError(f"{name}: {x!r}, expected > 0 (at least the smallest float32, 2**-149)")


def check_flag(name, x):
    if not isinstance(x, bool):
        raise ValueError(f"{name}: expected a bool, got {type(x).__name__}")


def check_weight_bias(name, x):
    if isinstance(x, bool) or not isinstance(x, int) or x not in (0, 1):
        raise ValueError(f"{name}: {x!r}, expected the int 0 or 1")


def check_unused(quant, a):
    """An argument given with a `quant` that does not read or write it is an error, not ignored: each
    argument of the description with `quants` (tensors first), against its default. `a`: the call's
    arguments (a mapping; one left out is at its default)."""
    for arg in _QUANT_SPECIFIC:
        value = a.get(arg.name, arg.default)
        if quant in arg.quants or (value is None if arg.default is None else value == arg.default):
            continue
        if arg.output:
            inputs = [other.name for other in _QUANT_SPECIFIC
                      if quant in other.quants and not other.output and other.schema.startswith("Tensor")]
            raise ValueError(f"{arg.name}: given with quant={quant!r}, which writes no {arg.what}"
                             + "".join(f" (its scale is the {name} input)" for name in inputs))
        given = "" if arg.schema.startswith("Tensor") else f"{value!r} "
        users = " and ".join(repr(q) for q in arg.quants)
        raise ValueError(f"{arg.name}: {given}given with quant={quant!r}, which does not use it (only {users} "
                         f"{'does' if len(arg.quants) == 1 else 'do'})")


def check_call_arguments(ws, a):
    """Validate one call's keyword arguments (dict) in place; returns (T, K, R, profile)."""
    D = ws.dtype
    H = ws.hidden
    idx = a["expanded_idx_to_permuted_idx"]
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
        raise ValueError("expanded_idx_to_permuted_idx: expected a [tokens, top_k] int32 tensor")
    T, K = idx.shape
    ins = [_tensor("expanded_idx_to_permuted_idx", idx, ws, (torch.int32,), ndim=2, align=4)]  # read
    if T > ws.max_tokens:
        raise ValueError(f"expanded_idx_to_permuted_idx: {T} tokens, more than the workspace's max_tokens "
                         f"{ws.max_tokens}")
    if not 1 <= K <= MAX_TOP_K:
        raise ValueError(f"expanded_idx_to_permuted_idx: top_k {K} out of range 1..{MAX_TOP_K}")
    x = a["allreduce_in"]
    ins.append(_tensor("allreduce_in", x, ws, (D,), ndim=2))
    R, Hx = x.shape
    if Hx != H:
        raise ValueError(f"allreduce_in: hidden {Hx}, the workspace was made for hidden {H}")
    if R < T * K:
        raise ValueError(f"allreduce_in: {R} rows, fewer than tokens * top_k = {T * K}")
    if R >= 2 ** 31:
        raise ValueError(f"allreduce_in: {R} rows, more than int32 indices can address")
    if a["expert_scale_factor"] is not None:
        ins.append(_tensor("expert_scale_factor", a["expert_scale_factor"], ws, (D, torch.float32), shape=(T, K),
                           align=4))
    if a["shared_expert_output"] is not None:
        ins.append(_tensor("shared_expert_output", a["shared_expert_output"], ws, (D,), shape=(T, H)))
    ins.append(_tensor("residual_in", a["residual_in"], ws, (D,), shape=(T, H)))
    ins.append(_tensor("norm_weight", a["norm_weight"], ws, (D,), shape=(H,)))
    quant = a["quant"]
    profile = profile_for_quant(quant)
    layout = a["fp8_scale_layout"]
    if not isinstance(layout, str) or layout not in FP8_SCALE_LAYOUTS:
        raise ValueError(f"fp8_scale_layout: {layout!r}, expected 'row' or 'column'")
    check_flag("fp8_pow2_scales", a["fp8_pow2_scales"])
    check_unused(quant, a)
    if quant == "nvfp4":
        if a["global_scale"] is None:
            raise ValueError("global_scale: required for quant='nvfp4' (a [1] float32 device tensor)")
        ins.append(_tensor("global_scale", a["global_scale"], ws, (torch.float32,), shape=(1,), align=4))
    if quant == "fp8_tensor":
        if a["fp8_scale"] is None:
            raise ValueError("fp8_scale: required for quant='fp8_tensor' (a [1] float32 device tensor)")
        ins.append(_tensor("fp8_scale", a["fp8_scale"], ws, (torch.float32,), shape=(1,), align=4))
    if quant == "fp8_group128" and H % FP8_GROUP:
        raise ValueError(f"quant: 'fp8_group128' needs hidden to be a multiple of {FP8_GROUP}, the workspace has "
                         f"hidden {H}")
    check_scalar("eps", a["eps"], positive=True)
    check_scalar("routed_scaling_factor", a["routed_scaling_factor"])
    check_weight_bias("weight_bias", a["weight_bias"])
    check_flag("launch_with_pdl", a["launch_with_pdl"])
    if a["program"] is not None and not isinstance(a["program"], str):
        raise ValueError(f"program: expected a program name (str) or None, got {type(a['program']).__name__}")
    outs = []  # written
    if a["norm_out"] is not None:
        outs.append(_tensor("norm_out", a["norm_out"], ws, (D,), shape=(T, H)))
    if a["residual_out"] is not None:
        outs.append(_tensor("residual_out", a["residual_out"], ws, (D,), shape=(T, H)))
    q, s = a["quant_out"], a["scale_out"]  # None unless quant writes them (check_unused)
    if quant == "nvfp4":
        if q is not None:
            outs.append(_tensor("quant_out", q, ws, (torch.uint8,), shape=(T, H // 2), align=4))
        if s is not None:
            outs.append(_tensor("scale_out", s, ws, (torch.uint8,), ndim=1, align=4))
            if s.numel() < scale_out_bytes(T, H):
                raise ValueError(f"scale_out: {s.numel()} bytes, need {scale_out_bytes(T, H)}")
    if quant in ("fp8_group128", "fp8_tensor") and q is not None:
        outs.append(_tensor("quant_out", q, ws, (torch.float8_e4m3fn,), shape=(T, H), align=16))
    if quant == "fp8_group128" and s is not None:
        outs.append(_tensor("scale_out", s, ws, (torch.float32,), shape=fp8_scale_shape(T, H, layout), align=4))
    if outs:
        check_overlaps(outs, ins)
    return T, K, R, profile


# ---- the call's arguments, described once ---------------------------------------------------------

@dataclass(frozen=True)
class Argument:
    """One argument of the call. The description (ARGUMENTS) gives op.moe_finalize_allreduce's signature, the
    torch op's schema, its kernels, fake and keyword wrapper (torch_op.py) and what the FlashInfer entry passes
    on (flashinfer_compat.py); adding an argument is one entry here (and its use in the checks and the kernel)."""
    name: str
    schema: str  # its type in the torch op's schema: Tensor, Tensor?, float, SymInt, bool, str, str?
    default: object = inspect.Parameter.empty  # empty: required
    quants: tuple | None = None  # the quant values that use it; None: every call. Given with another: refused
    check: tuple = ()  # (function, *more): function(name, value, *more) refuses what the schema would convert
    output: bool = False  # written by the call (allocated when not given); the out op takes it
    appended: bool = False  # added after the op's schema was published: in the schema after the others
    what: str = ""  # an output: what it holds, for the refusal of one given with a quant that writes none


def _writers(output: str) -> tuple:
    """The quant values that write `output` (outputs.QUANT_OUTPUTS)."""
    i = QUANT_OUTPUT_NAMES.index(output)
    return tuple(quant for quant, outs in QUANT_OUTPUTS.items() if outs[i][1] is not None)


# In the order op.moe_finalize_allreduce shows them: the inputs without a default, then every other.
ARGUMENTS = (
    Argument("allreduce_in", "Tensor"),
    Argument("expanded_idx_to_permuted_idx", "Tensor"),
    Argument("residual_in", "Tensor"),
    Argument("norm_weight", "Tensor"),
    Argument("expert_scale_factor", "Tensor?", None),
    Argument("routed_scaling_factor", "float", 1.0, check=(check_scalar,)),
    Argument("shared_expert_output", "Tensor?", None),
    Argument("eps", "float", 1e-6, check=(check_scalar, True)),  # True: positive
    Argument("weight_bias", "SymInt", 0, check=(check_weight_bias,)),
    Argument("quant", "str?", None),
    Argument("global_scale", "Tensor?", None, quants=("nvfp4",)),
    Argument("fp8_scale", "Tensor?", None, quants=("fp8_tensor",), appended=True),
    Argument("fp8_scale_layout", "str", "row", quants=("fp8_group128",), appended=True),
    Argument("fp8_pow2_scales", "bool", False, quants=("fp8_group128",), check=(check_flag,), appended=True),
    Argument("norm_out", "Tensor?", None, output=True),
    Argument("residual_out", "Tensor?", None, output=True),
    Argument("quant_out", "Tensor?", None, quants=_writers("quant_out"), output=True, what="quantized output"),
    Argument("scale_out", "Tensor?", None, quants=_writers("scale_out"), output=True, what="scales"),
    Argument("launch_with_pdl", "bool", False, check=(check_flag,)),
    Argument("program", "str?", None),
)
REQUIRED = tuple(arg.name for arg in ARGUMENTS if arg.default is inspect.Parameter.empty)
CALL_DEFAULTS = {arg.name: arg.default for arg in ARGUMENTS if arg.default is not inspect.Parameter.empty}
_QUANT_SPECIFIC = sorted((arg for arg in ARGUMENTS if arg.quants is not None),
                         key=lambda arg: not arg.schema.startswith("Tensor"))


def call_signature() -> inspect.Signature:
    """moe_finalize_allreduce(workspace, *, <REQUIRED>, <each of CALL_DEFAULTS with its default>), as help()
    and inspect.signature show it."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [inspect.Parameter("workspace", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         *(inspect.Parameter(name, keyword) for name in REQUIRED),
         *(inspect.Parameter(name, keyword, default=default) for name, default in CALL_DEFAULTS.items())],
        return_annotation=MoeFinalizeOutputs)


# ---- functions written from the description --------------------------------------------------------

_ANNOTATIONS = {"Tensor": "torch.Tensor", "Tensor?": "Optional[torch.Tensor]", "float": "float", "SymInt": "int",
                "bool": "bool", "str": "str", "str?": "Optional[str]"}
_sources = itertools.count()


def parameter(arg: Argument, annotate: bool = False, default: bool = True) -> str:
    """`arg` as a parameter in Python source: name[: annotation][=default]."""
    text = arg.name + (": " + _ANNOTATIONS[arg.schema] if annotate else "")
    if default and arg.default is not inspect.Parameter.empty:
        text += (" = " if annotate else "=") + repr(arg.default)
    return text


def checks(arguments, namespace: dict, indent: str = "    ") -> str:
    """Source lines that run each argument's check on the parameter of its name (the functions put into
    `namespace` under their own names)."""
    lines = []
    for arg in arguments:
        if arg.check:
            function, *more = arg.check
            namespace[function.__name__] = function
            lines.append(f"{indent}{function.__name__}({', '.join([repr(arg.name), arg.name, *map(repr, more)])})")
    return "\n".join(lines)


def define(source: str, namespace: dict, name: str):
    """Compile the function `name` from `source` into `namespace` (a module's globals) and return it. The
    source is kept in linecache, so tracebacks and inspect.getsource show it. A function written from the
    description costs a call what the same function written by hand would: the work is done here, once."""
    filename = f"<dispatch: {namespace.get('__name__', '?')}.{name} #{next(_sources)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    return namespace[name]
