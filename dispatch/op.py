"""The call: check the arguments, pick the program, launch it on torch's current stream.

The launch path does no device allocation (unless outputs are not passed in, when it takes them
from torch's caching allocator, as any torch op does), no synchronization and no hashing of
sources: programs are compiled and their launch state built once, at a workspace's first call
of each program (or ahead of time with dispatch.warmup).
"""
from __future__ import annotations

import ctypes
import struct
from typing import NamedTuple, Optional

import torch

from . import registry

MAX_TOP_K = 16
FP8_GROUP = 128
FP8_SCALE_LAYOUTS = ("row", "column")
_QUANT_FLAG_COLUMN_MAJOR, _QUANT_FLAG_POW2 = 1, 2  # Params.quant_flags bits (the template's QuantFlag)


class MoeFinalizeOutputs(NamedTuple):
    norm_out: torch.Tensor
    residual_out: torch.Tensor
    quant_out: Optional[torch.Tensor]
    scale_out: Optional[torch.Tensor]


def scale_out_bytes(tokens: int, hidden: int) -> int:
    """Bytes of the swizzled NVFP4 scale buffer: rows padded to 128, scale columns to 4."""
    return -(-tokens // 128) * 128 * (-(-(hidden // 16) // 4) * 4)


def fp8_scale_shape(tokens: int, hidden: int, layout: str = "row") -> tuple:
    """Shape of the float32 fp8_group128 scales: [T, H/128] ("row"), or [H/128, roundup(T, 4)]
    ("column": column-major and TMA-aligned as DeepGEMM-style consumers read it; `.t()[:T]` is the
    [T, H/128] view)."""
    groups = hidden // FP8_GROUP
    return (tokens, groups) if layout == "row" else (groups, -(-tokens // 4) * 4)


def profile_for_quant(quant) -> str:
    """The output profile `quant` asks for (from the manifest; no copy on the call path)."""
    profiles = registry.program_set().profile_of_quant
    if not isinstance(quant, (str, type(None))) or quant not in profiles:
        raise ValueError(f"quant: {quant!r}, expected one of {', '.join(repr(q) for q in profiles)}")
    return profiles[quant]


# ---- argument checks --------------------------------------------------------------------

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


def check_weight_bias(x):
    if isinstance(x, bool) or not isinstance(x, int) or x not in (0, 1):
        raise ValueError(f"weight_bias: {x!r}, expected the int 0 or 1")


def check_unused(quant, global_scale, fp8_scale, quant_out, scale_out, fp8_scale_layout, fp8_pow2_scales):
    """An argument given with a `quant` that does not read or write it is an error, not ignored."""
    if global_scale is not None and quant != "nvfp4":
        raise ValueError(f"global_scale: given with quant={quant!r}, which does not use it (only 'nvfp4' does)")
    if fp8_scale is not None and quant != "fp8_tensor":
        raise ValueError(f"fp8_scale: given with quant={quant!r}, which does not use it (only 'fp8_tensor' does)")
    if quant_out is not None and quant is None:
        raise ValueError("quant_out: given with quant=None, which writes no quantized output")
    if scale_out is not None and quant in (None, "fp8_tensor"):
        raise ValueError(f"scale_out: given with quant={quant!r}, which writes no scales"
                         + (" (its scale is the fp8_scale input)" if quant else ""))
    if quant != "fp8_group128":
        if fp8_scale_layout != "row":
            raise ValueError(f"fp8_scale_layout: {fp8_scale_layout!r} given with quant={quant!r}, which does not "
                             f"use it (only 'fp8_group128' does)")
        if fp8_pow2_scales:
            raise ValueError(f"fp8_pow2_scales: True given with quant={quant!r}, which does not use it (only "
                             f"'fp8_group128' does)")


_OVERLAP_RULE = ("an output must not share memory with an input or another output; only residual_out may be "
                 "residual_in itself (in place: the same data pointer, shape and dtype)")


def _check_overlaps(outputs, inputs):
    """outputs, inputs: lists of (name, tensor, data pointer) of checked (contiguous) tensors, whose
    bytes are exactly [pointer, pointer + nbytes). Raises ValueError naming the output for any
    shared byte, except residual_out exactly over residual_in."""
    outputs = [(name, p, p + x.nbytes) for name, x, p in outputs]
    inputs = [(name, p, p + x.nbytes) for name, x, p in inputs]
    for j, (name, lo, hi) in enumerate(outputs):
        if lo == hi:
            continue
        for other, olo, ohi in outputs[:j]:
            if lo < ohi and olo < hi:
                raise ValueError(f"{other}: overlaps {name} in memory; {_OVERLAP_RULE}")
        for other, olo, ohi in inputs:
            if lo < ohi and olo < hi:
                if name == "residual_out" and other == "residual_in":
                    if lo == olo and hi == ohi:  # both [T, H] D: residual_in itself
                        continue
                    raise ValueError(f"residual_out: overlaps residual_in in memory without being residual_in "
                                     f"itself; {_OVERLAP_RULE}")
                raise ValueError(f"{name}: overlaps {other} in memory; {_OVERLAP_RULE}")


def _check_args(ws, a):
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
    check_unused(quant, a["global_scale"], a["fp8_scale"], a["quant_out"], a["scale_out"], layout,
                 a["fp8_pow2_scales"])
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
    check_weight_bias(a["weight_bias"])
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
        _check_overlaps(outs, ins)
    return T, K, R, profile


def _spans(a):
    """(name, first byte, one past the last byte, is an output) of every non-empty tensor a checked
    call reads or writes (outputs allocated or given)."""
    out = []
    for names, is_out in ((_OUTPUT_NAMES, True), (_INPUT_NAMES, False)):
        for name in names:
            x = a.get(name)
            if isinstance(x, torch.Tensor) and x.numel():
                p = x.data_ptr()
                out.append((name, p, p + x.numel() * x.element_size(), is_out))
    return out


_OUTPUT_NAMES = ("norm_out", "residual_out", "quant_out", "scale_out")
_INPUT_NAMES = ("allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
                "residual_in", "norm_weight", "global_scale", "fp8_scale")


def check_rank_overlaps(per_rank_args) -> None:
    """All ranks in one process (EmulatedWorld.run): an output of one rank sharing memory with any
    tensor of another rank is a ValueError naming per_rank_kwargs[r] and the argument. per_rank_args:
    each rank's checked arguments (with its outputs); inputs may be shared by ranks."""
    spans = sorted((lo, hi, r, name, is_out) for r, a in enumerate(per_rank_args)
                   for name, lo, hi, is_out in _spans(a))
    active = []  # spans that may still overlap what comes next (sorted by start)
    for lo, hi, r, name, is_out in spans:
        active = [s for s in active if s[1] > lo]
        for _, _, r2, name2, is_out2 in active:
            if r2 != r and (is_out or is_out2):
                (ro, no), (ri, ni) = ((r, name), (r2, name2)) if is_out else ((r2, name2), (r, name))
                raise ValueError(f"per_rank_kwargs[{ro}]: {no} overlaps {ni} of per_rank_kwargs[{ri}] in memory "
                                 f"(each rank's outputs need memory of their own)")
        active.append((lo, hi, r, name, is_out))


_DEFAULTS = dict(expert_scale_factor=None, routed_scaling_factor=1.0, shared_expert_output=None, eps=1e-6,
                 weight_bias=0, quant=None, global_scale=None, fp8_scale=None, fp8_scale_layout="row",
                 fp8_pow2_scales=False, norm_out=None, residual_out=None, quant_out=None, scale_out=None,
                 launch_with_pdl=False, program=None)


def allocate_outputs(ws, kwargs: dict) -> dict:
    """Fill in the output tensors the call did not pass, from torch's caching allocator (prepare_call,
    so before EmulatedWorld.run forks its streams)."""
    T = kwargs["expanded_idx_to_permuted_idx"].shape[0]
    H = ws.hidden
    if kwargs.get("norm_out") is None:
        kwargs["norm_out"] = torch.empty((T, H), dtype=ws.dtype, device=ws.device)
    if kwargs.get("residual_out") is None:
        kwargs["residual_out"] = torch.empty((T, H), dtype=ws.dtype, device=ws.device)
    quant = kwargs.get("quant")
    if quant == "nvfp4":
        if kwargs.get("quant_out") is None:
            kwargs["quant_out"] = torch.empty((T, H // 2), dtype=torch.uint8, device=ws.device)
        if kwargs.get("scale_out") is None:
            kwargs["scale_out"] = torch.empty((scale_out_bytes(T, H),), dtype=torch.uint8, device=ws.device)
    if quant in ("fp8_group128", "fp8_tensor") and kwargs.get("quant_out") is None:
        kwargs["quant_out"] = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=ws.device)
    if quant == "fp8_group128" and kwargs.get("scale_out") is None:
        layout = kwargs.get("fp8_scale_layout", "row")
        kwargs["scale_out"] = torch.empty(fp8_scale_shape(T, H, layout), dtype=torch.float32, device=ws.device)
    return kwargs


# ---- selection --------------------------------------------------------------------------

def select_program(ws, tokens: int, quant=None, has_shared: bool = False) -> str:
    """The program the dispatcher runs on this rank for a call of `tokens` tokens with `quant`
    (None, "nvfp4", "fp8_group128" or "fp8_tensor") and, when `has_shared`, a shared-expert operand.
    Raises ValueError for a bad `quant` or ("program: ...") when no program covers the cell."""
    profile = profile_for_quant(quant)
    family = registry.select_family(ws.dtype_name, ws.world_size, profile, tokens, has_shared, ws.oneshot_max_tokens,
                                    bounds=ws.selection.limits(profile))
    return registry.program_for(family, ws.dtype_name, ws.world_size, profile)


# ---- launch -------------------------------------------------------------------------------

class _Launcher:
    """One program on one workspace: the loaded kernel, its grid limit, a reusable argument struct
    with the per-workspace fields filled in, and prebuilt launch configurations."""

    def __init__(self, ws, name: str):
        info = registry.program_info(name)
        if info["dtype"] != ws.dtype_name or info["world_size"] != ws.world_size:
            raise ValueError(f"program: {name} is for {info['dtype']} world size {info['world_size']}, the workspace "
                             f"is {ws.dtype_name} world size {ws.world_size}")
        self.name = name
        self.family = info["family"]
        self.regime = info["regime"]
        self.profile = info["profile"]
        self.sliced_units = info["sliced_units"]  # a work unit is a row slice, not a whole row
        self.column_units = info["column_units"]  # a work unit is a column: a token of each rank
        prog = registry.load(name, ws.device_index)
        sms = torch.cuda.get_device_properties(ws.device).multi_processor_count
        # Every block of every rank on this GPU must be resident at once: blocks spin on peers.
        # When ranks share a GPU (emulation), each rank may have two kernels resident (its current
        # one and the next, started early by PDL), and blocks of different programs (different
        # register counts) pack onto SMs with some waste: a run that filled the GPU to 100% of
        # the occupancy figure left a rank's blocks unplaced and timed out. Each kernel gets a
        # quarter of its rank's share, so four kernels per rank would still fit.
        sharing = ws.ranks_on_device * (4 if ws.ranks_on_device > 1 else 1)
        if ws.ranks_on_device > 1:
            # An SM holds blocks of two kernels at once only in one split of its memory between L1
            # and shared memory, chosen per kernel. Two-shot blocks spinning on a peer rank, in a
            # split with little shared memory, on every SM, left no SM for that rank's pipelined
            # blocks with their row ring: a timeout (seen on one GPU: tse and tsp at 303 tokens).
            # So here every program asks for the largest shared memory. The attribute stays with
            # the loaded program for the process (tests that also run one rank a GPU).
            prog.prefer_largest_shared_memory()
        self.dynamic_smem = registry.dynamic_smem_bytes(info, ws.hidden, ws.dtype.itemsize)
        self.max_blocks = []  # per row split of the workspace
        for split in ws.row_splits:
            per_sm = prog.max_blocks_per_sm(split.threads, self.dynamic_smem)
            if per_sm < 1:
                raise ValueError(f"hidden: {ws.hidden} needs {split.threads} threads a block, which {name} cannot run")
            self.max_blocks.append(max(1, per_sm * sms // sharing))
        self.function_ptr = prog.function_ptr
        self.threads = [split.threads for split in ws.row_splits]
        # The fields every call of this program on this workspace shares.
        template = self.template = registry.params_struct()()
        for r, ptr in enumerate(ws.peer_buffer_ptrs):
            template.peer_buffers[r] = ptr or None
        template.state = ws._memory.state
        template.error = ws._memory.error_host
        template.buffer_elems = ws.buffer_elems
        template.timeout_ns = ws.timeout_ns
        template.hidden = ws.hidden
        template.rank = ws.rank
        self.pointer_base = type(template).allreduce_in.offset
        self.device_index = ws.device_index
        _driver()  # loaded here, not on the launch path

    def kernel_call(self, ws, T, a, order) -> "_KernelCall":
        """The launch state of a call signature: the kernel argument with this program's fields and the
        call's scalars, where the data pointers of `order` (call argument names, in kernel field
        order) go in it, and the launch configuration."""
        params = type(self.template)()
        ctypes.memmove(ctypes.addressof(params), ctypes.addressof(self.template), ctypes.sizeof(params))
        scale = a["expert_scale_factor"]
        params.scale_kind = 0 if scale is None else (1 if scale.dtype == torch.float32 else 2)
        params.quant_flags = ((_QUANT_FLAG_COLUMN_MAJOR if a["fp8_scale_layout"] == "column" else 0)
                              | (_QUANT_FLAG_POW2 if a["fp8_pow2_scales"] else 0))
        params.fault_stop_after = ws._fault_stop_after_units
        params.tokens, params.top_k, params.rows = T, a["expanded_idx_to_permuted_idx"].shape[1], \
            a["allreduce_in"].shape[0]
        params.routed_scaling_factor = a["routed_scaling_factor"]
        params.eps = a["eps"]
        params.weight_bias = float(a["weight_bias"])
        params.vec_per_thread = ws.row_splits[ws.row_split_index(T)].vec_per_thread
        return _KernelCall(params, order, self.config_for(ws, T, a["launch_with_pdl"]))

    def config_for(self, ws, T, pdl):
        """The launch configuration of a call of T tokens (the stream is set at each launch)."""
        i = ws.row_split_index(T)
        config = _LaunchConfig()
        if self.sliced_units:  # a unit is one row slice
            config.gridDimX = min(T * ws.row_splits[i].vec_per_thread, self.max_blocks[i])
        elif self.column_units:  # a unit is one column: a token of each rank
            config.gridDimX = balanced_grid(-(-T // ws.world_size), self.max_blocks[i])
        else:  # a unit is one row
            config.gridDimX = min(T, self.max_blocks[i])
        config.gridDimY = config.gridDimZ = config.blockDimY = config.blockDimZ = 1
        config.blockDimX = self.threads[i]
        config.sharedMemBytes = self.dynamic_smem
        if pdl:
            config.attrs, config.numAttrs = _PDL_ATTRIBUTE, 1
        return config

    def launch(self, kernel: "_KernelCall", pointers) -> None:
        """Launch on the current stream; `pointers`: the data pointers in the kernel call's order."""
        kernel.packer.pack_into(kernel.params, self.pointer_base, *pointers)
        kernel.config.hStream = _current_stream(self.device_index)
        err = _cu_launch_kernel_ex(kernel.config_ref, self.function_ptr, kernel.param_pointer, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx({self.name}) failed: CUresult {err}")


class _KernelCall:
    """A launch of one program for one call signature (everything but the data pointers and stream)."""

    __slots__ = ("params", "param_pointer", "packer", "config", "config_ref")

    def __init__(self, params, order, config):
        self.params, self.config = params, config
        self.param_pointer = (ctypes.c_void_p * 1)(ctypes.addressof(params))  # cuLaunchKernelEx's kernelParams
        self.config_ref = ctypes.byref(config)
        # The pointer fields are consecutive 8-byte words (generator/abi.py): the call's pointers go
        # to the fields of `order`, in order; the others stay 0 (struct pad bytes).
        fields = {_FIELD_OF[name] for name in order}
        self.packer = struct.Struct("<" + "".join("Q" if f in fields else "8x" for f in _POINTER_FIELDS))


# ---- the driver call -------------------------------------------------------------------------
# cuLaunchKernelEx straight through ctypes: its configuration is a prebuilt structure per call
# signature, so a launch sets the stream and makes one foreign call (layouts from cuda.h).

class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_PDL_ATTRIBUTE = (_LaunchAttribute * 1)()
_PDL_ATTRIBUTE[0].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL_ATTRIBUTE[0].value.programmaticStreamSerializationAllowed = 1
_cu_launch_kernel_ex = None


def _driver() -> None:
    """Load the driver's cuLaunchKernelEx (once). Called with the GIL held (PyDLL), as torch launches:
    a launch returns at once, and letting the GIL go and taking it back per call costs more."""
    global _cu_launch_kernel_ex
    if _cu_launch_kernel_ex is None:
        libcuda = ctypes.PyDLL("libcuda.so.1")
        fn = libcuda.cuLaunchKernelEx
        fn.restype = ctypes.c_int
        fn.argtypes = (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        _cu_launch_kernel_ex = fn


def _current_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _current_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811  (the same value, without a Stream object)


def balanced_grid(units: int, max_blocks: int) -> int:
    """Blocks for `units` columns of the pipelined two-shot: as many as fit, less the ones that would
    leave the other blocks a round of columns to do alone. Every block then takes the same number of
    columns, give or take one at the end (1,024 columns, 396 blocks fit: 342 blocks of 3 columns,
    not 232 blocks of 3 and 164 of 2). A last round run by a few blocks leaves HBM idle: at H 7168
    on 2x H200, 1,600 tokens took 111.6 us against 1,584's 93.0 (2 columns a block, 396 blocks);
    this grid, 107.0 (bench_results/pipelined/grid/)."""
    grid = min(units, max_blocks)
    rounds = -(-units // grid)
    return -(-units // rounds)


def _launcher(ws, name: str) -> _Launcher:
    launcher = ws._launchers.get(name)
    if launcher is None:
        launcher = ws._launchers[name] = _Launcher(ws, name)
    return launcher


def moe_finalize_allreduce(workspace, *, allreduce_in, expanded_idx_to_permuted_idx, residual_in, norm_weight,
                           **kwargs) -> MoeFinalizeOutputs:
    """MoE finalize + all-reduce + residual add + RMSNorm (+ NVFP4) for this rank.

    Shapes (T tokens, K = top_k, H = workspace.hidden, D = workspace.dtype):
      allreduce_in [R, H] D (R >= T*K, R < 2**31), expanded_idx_to_permuted_idx [T, K] int32 (< 0: dropped
      route; >= R: skipped and reported by dispatch.check()), expert_scale_factor [T, K] D or float32
      (default None: 1), routed_scaling_factor Python float (default 1.0), shared_expert_output [T, H] D
      (default None), residual_in [T, H] D, norm_weight [H] D, eps Python float (default 1e-6),
      weight_bias 0 or 1 (default 0), quant (default None), one of
        None            plain output;
        "nvfp4"         with global_scale [1] float32;
        "fp8_group128"  FP8 E4M3 with a float32 scale per 128 elements of a token (H % 128 == 0),
                        fp8_scale_layout "row" (default) or "column", fp8_pow2_scales (default False);
        "fp8_tensor"    FP8 E4M3 with fp8_scale [1] float32 (q = e4m3(clamp(x / fp8_scale, -448, 448))).
    1 <= K <= 16, T <= workspace.max_tokens. Every tensor contiguous and on the workspace's device;
    16-byte aligned, except the index, scale, global_scale, fp8_scale and NVFP4 quant_out and every
    scale_out (4 bytes).
    Outputs (allocated when not given): norm_out [T, H] D, residual_out [T, H] D, and
      "nvfp4":        quant_out [T, H/2] uint8, scale_out 1-D uint8 >= scale_out_bytes(T, H), 128x4 swizzled;
      "fp8_group128": quant_out [T, H] float8_e4m3fn, scale_out float32 fp8_scale_shape(T, H, layout):
                      [T, H/128] row-major, or [H/128, roundup(T, 4)] column-major (padding written 0);
      "fp8_tensor":   quant_out [T, H] float8_e4m3fn (scale_out is None).
    eps must be > 0 and routed_scaling_factor finite (as float32s); weight_bias an int, not a bool.
    An output sharing memory with an input or another output is refused, except residual_out being
    residual_in itself (in place); so is global_scale, fp8_scale, quant_out or scale_out given with a
    quant that does not use it. Device scales are not checked: see dispatch/API.md for the bytes any
    value gives.
    Every rank of the group must make the same sequence of calls with the same T; residual_in and
    norm_weight must hold the same values on every rank (tensor parallelism replicates them).
    `program=` forces a program by name. `launch_with_pdl=True` lets the kernel start while the
    previous kernel on the stream finishes (programmatic dependent launch).
    Raises ValueError naming the argument for a bad call, RuntimeError if an earlier call of this
    workspace timed out waiting for a peer.
    """
    kwargs["allreduce_in"] = allreduce_in
    kwargs["expanded_idx_to_permuted_idx"] = expanded_idx_to_permuted_idx
    kwargs["residual_in"] = residual_in
    kwargs["norm_weight"] = norm_weight
    recent = workspace._recent_plans
    if recent and not recent[0].fill:  # the short path of prepare_call, without a _Call
        workspace._ensure_open()
        workspace._check_error_words()
        plan = recent[0]
        pointers = plan.match(workspace, kwargs)
        if pointers is not None:
            return plan.run(pointers, kwargs)
    return prepare_call(workspace, kwargs).launch()


# ---- the call: a plan per call signature ----------------------------------------------------
#
# Everything the checks and the program choice depend on, except the data pointers, is a function
# of the call's signature: each argument's name and, for a tensor, its dtype, shape and device, for
# anything else its type and value (plus the workspace's fault-injection setting). The first call
# of a signature runs every check (_check_args) and keeps a _Plan: the program, the grid, the
# kernel argument with the call's scalars filled in, each tensor's dtype, shape and byte size. A
# later call is first matched against the workspace's most recent plans (an engine repeats one
# signature over all its layers, or alternates between a few), then looked up by signature; a
# plan's match compares the signature directly, stopping at the first difference, and makes the
# checks a signature does not fix (contiguity, alignment, overlap) in one pass over the tensors.
# Anything unexpected takes the full path, which raises the ValueError naming the argument.

_PLANS_PER_WORKSPACE = 1024  # a workspace drops its plans past this many signatures
_RECENT_PLANS = 4  # plans matched before any signature is built, most recently used first
_POINTER_FIELDS = ("allreduce_in", "expanded_idx", "expert_scale", "shared_in", "residual_in", "norm_weight",
                   "quant_scale", "norm_out", "residual_out", "quant_out", "scale_out")
# The kernel argument fields each call argument's data pointer goes to.
_FIELD_OF = {"allreduce_in": "allreduce_in", "expanded_idx_to_permuted_idx": "expanded_idx",
             "expert_scale_factor": "expert_scale", "shared_expert_output": "shared_in", "residual_in": "residual_in",
             "norm_weight": "norm_weight", "global_scale": "quant_scale", "fp8_scale": "quant_scale",
             "norm_out": "norm_out", "residual_out": "residual_out", "quant_out": "quant_out", "scale_out": "scale_out"}
_ALIGN = {"expanded_idx_to_permuted_idx": 4, "expert_scale_factor": 4, "global_scale": 4, "fp8_scale": 4,
          "scale_out": 4}


def _pointer_order(a) -> tuple:
    """The call arguments whose data pointers a checked call `a` passes to the kernel, in the
    order of their kernel argument fields (_POINTER_FIELDS)."""
    quant = a["quant"]
    names = ["allreduce_in", "expanded_idx_to_permuted_idx"]
    names += [n for n in ("expert_scale_factor", "shared_expert_output") if a[n] is not None]
    names += ["residual_in", "norm_weight"]
    if quant == "nvfp4":
        names.append("global_scale")
    elif quant == "fp8_tensor":
        names.append("fp8_scale")
    names += ["norm_out", "residual_out"]
    if quant is not None:
        names.append("quant_out")
    if quant in ("nvfp4", "fp8_group128"):
        names.append("scale_out")
    return tuple(names)


def _signature(ws, kwargs: dict):
    """The dictionary key of a call's plan: each argument's name and, for a tensor, dtype, shape and
    device, for anything else type and value. None when an argument has no cheap one."""
    parts = [ws._fault_stop_after_units]
    try:
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                parts.append((name, value.dtype, value.shape, value.device))
            else:
                parts.append((name, type(value), value))
        signature = tuple(parts)
        hash(signature)
    except (RuntimeError, TypeError):  # a tensor without metadata, an unhashable value: the full checks
        return None
    return signature


class _Plan:
    """One call signature on one workspace, checked once (see above)."""

    __slots__ = ("names", "fault", "device", "scalars", "tensors", "pairs", "fill", "launcher", "kernel",
                 "writes_quant", "writes_scales")

    def __init__(self, ws, launcher, T, a: dict, given: dict):
        """`a`: the checked call with defaults filled in; `given`: the arguments as the caller passed them."""
        order = _pointer_order(a)
        tensors = [name for name in order if isinstance(given.get(name), torch.Tensor)]
        if any(isinstance(v, torch.Tensor) and name not in tensors for name, v in given.items()):
            raise RuntimeError("moe_finalize_allreduce: internal error: a checked call has a tensor the kernel "
                               "does not take")
        self.names = frozenset(given)
        self.fault = ws._fault_stop_after_units
        self.device = ws.device
        self.scalars = tuple((name, type(v), v) for name, v in given.items() if not isinstance(v, torch.Tensor))
        # (name, dtype, shape, alignment mask) of each tensor given, in kernel order
        self.tensors = tuple((name, given[name].dtype, tuple(given[name].shape), _ALIGN.get(name, 16) - 1)
                             for name in tensors)
        # The overlap rule (_check_overlaps) as pairs (i, j, bytes of i, bytes of j, in place allowed)
        # of tensors[i] an output and tensors[j] anything else, both non-empty.
        nbytes = [given[name].numel() * given[name].element_size() for name in tensors]
        self.pairs = tuple((i, j, nbytes[i], nbytes[j], {n, m} == {"residual_out", "residual_in"})
                           for i, n in enumerate(tensors) if n in _OUTPUT_NAMES and nbytes[i]
                           for j, m in enumerate(tensors)
                           if j != i and nbytes[j] and not (m in _OUTPUT_NAMES and j < i))
        # (position in kernel order, name) of each output the caller did not give: allocated per call
        self.fill = tuple((i, name) for i, name in enumerate(order) if name not in tensors)
        self.launcher = launcher
        self.kernel = launcher.kernel_call(ws, T, a, order) if launcher is not None else None  # None: T is 0
        self.writes_quant = a["quant"] is not None
        self.writes_scales = a["quant"] in ("nvfp4", "fp8_group128")

    def match(self, ws, kw: dict):
        """The data pointers of the call's tensors, in kernel order, when `kw` has this plan's signature
        and passes the checks a signature does not fix (contiguity, alignment, overlap); else None
        (the caller looks further, and the full checks name what is wrong)."""
        if kw.keys() != self.names or ws._fault_stop_after_units != self.fault:
            return None
        for name, kind, value in self.scalars:
            v = kw[name]
            if type(v) is not kind or v != value:
                return None
        device = self.device
        pointers = []
        misaligned = 0
        try:
            for name, dtype, shape, mask in self.tensors:
                x = kw[name]
                if x.dtype is not dtype or x.shape != shape or x.device != device or not x.is_contiguous():
                    return None
                p = x.data_ptr()
                misaligned |= p & mask
                pointers.append(p)
        except (AttributeError, RuntimeError, TypeError):  # not a tensor, or one without storage (fake, meta)
            return None
        if misaligned:
            return None
        for i, j, ni, nj, in_place in self.pairs:
            pi, pj = pointers[i], pointers[j]
            if pi < pj + nj and pj < pi + ni and not (in_place and pi == pj):
                return None
        return pointers

    def with_outputs(self, pointers, kw: dict) -> list:
        """`pointers` with those of the outputs allocated for this call (allocate_outputs) put in."""
        pointers = list(pointers)
        for i, name in self.fill:
            x = kw.get(name)
            pointers.insert(i, x.data_ptr() if x is not None else 0)
        return pointers

    def outputs(self, kw: dict) -> MoeFinalizeOutputs:
        return MoeFinalizeOutputs(kw["norm_out"], kw["residual_out"], kw["quant_out"] if self.writes_quant else None,
                                  kw["scale_out"] if self.writes_scales else None)

    def run(self, pointers, kw: dict) -> MoeFinalizeOutputs:
        """Launch (nothing when T is 0); the call's outputs."""
        if self.kernel is not None:
            self.launcher.launch(self.kernel, pointers)
        return self.outputs(kw)


class _Call:
    """A checked call: its outputs, and the launch."""

    __slots__ = ("plan", "pointers", "outputs", "args")

    def __init__(self, plan, pointers, args):
        self.plan, self.pointers, self.args = plan, pointers, args
        self.outputs = plan.outputs(args)

    def launch(self) -> MoeFinalizeOutputs:
        return self.plan.run(self.pointers, self.args)


_REQUIRED = ("allreduce_in", "expanded_idx_to_permuted_idx", "residual_in", "norm_weight")
_KNOWN = frozenset(_DEFAULTS) | frozenset(_REQUIRED)


def prepare_call(workspace, kwargs: dict) -> _Call:
    """Everything of a call but the launch: checks, outputs, program choice (compiling it at first use).
    `kwargs` (the call's keyword arguments) gets the allocated outputs."""
    workspace._ensure_open()
    workspace._check_error_words()
    recent = workspace._recent_plans
    for i, plan in enumerate(recent):
        pointers = plan.match(workspace, kwargs)
        if pointers is not None:
            if i:
                recent.insert(0, recent.pop(i))
            break
    else:
        plan, pointers = _plan_for(workspace, kwargs)
        recent.insert(0, plan)
        del recent[_RECENT_PLANS:]
    if plan.fill:
        allocate_outputs(workspace, kwargs)
        pointers = plan.with_outputs(pointers, kwargs)
    return _Call(plan, pointers, kwargs)


def _plan_for(workspace, kwargs: dict):
    """(plan, data pointers) of a call that matched none of the workspace's recent plans: its
    signature's plan, or a new one after the full checks."""
    plans = workspace._plans
    signature = _signature(workspace, kwargs)
    plan = plans.get(signature) if signature is not None else None
    pointers = plan.match(workspace, kwargs) if plan is not None else None
    if pointers is None:
        plan = _full_checks(workspace, kwargs)
        pointers = plan.match(workspace, kwargs)
        if pointers is None:  # cannot happen after the full checks passed
            raise RuntimeError("moe_finalize_allreduce: internal error: a checked call failed its plan's checks")
        if signature is not None:
            if len(plans) >= _PLANS_PER_WORKSPACE:
                plans.clear()
            plans[signature] = plan
    return plan, pointers


def _full_checks(workspace, kwargs: dict) -> _Plan:
    """Every check of a call (ValueError naming the argument), and the plan for its signature."""
    unknown = set(kwargs) - _KNOWN
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown argument")
    for name in _REQUIRED:
        if name not in kwargs:
            raise ValueError(f"{name}: required")
    a = dict(_DEFAULTS)
    a.update(kwargs)
    T, K, R, profile = _check_args(workspace, a)
    if T == 0:
        return _Plan(workspace, None, T, a, kwargs)
    name = a["program"]
    if name is None:
        name = select_program(workspace, T, a["quant"], a["shared_expert_output"] is not None)
    launcher = _launcher(workspace, name)
    if launcher.profile != profile:
        raise ValueError(f"program: {name} writes output profile {launcher.profile}, the call asks for {profile}")
    if launcher.regime == "oneshot" and T > workspace.oneshot_max_tokens:
        raise ValueError(f"program: one-shot {name} at {T} tokens exceeds the workspace's oneshot_max_tokens "
                         f"{workspace.oneshot_max_tokens}")
    return _Plan(workspace, launcher, T, a, kwargs)
