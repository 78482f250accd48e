"""The plan of a call signature: what the full checks found, kept so that a later call of that
signature checks only what a signature does not fix.

Everything the checks and the program choice depend on, except the data pointers, is a function
of the call's signature: each argument's name and, for a tensor, its dtype, shape and device, for
anything else its type and value. (The workspace's test-only fault setting goes into a plan when it
is built, and setting it drops the workspace's plans: no call checks it; workspace_state.py.) The
first call of a signature runs every check (call_arguments.check_call_arguments) and keeps a
CallPlan: the program, the grid, the kernel argument with the call's scalars filled in, each
tensor's dtype, shape and byte size. A later call is first matched against the workspace's most recent plans (an engine repeats
one signature over all its layers, or alternates between a few), then looked up by signature; a
plan's match compares the signature directly, stopping at the first difference, and makes the
checks a signature does not fix (contiguity, alignment, overlap) in one pass over the tensors.
Anything unexpected takes the full path, which raises the ValueError naming the argument.
"""
from __future__ import annotations

import torch

from .outputs import MoeFinalizeOutputs
from .overlaps import overlap_pairs

_ALIGN = {"expanded_idx_to_permuted_idx": 4, "expert_scale_factor": 4, "global_scale": 4, "fp8_scale": 4,
          "scale_out": 4}


def _pointer_order(a) -> tuple:
    """The call arguments whose data pointers a checked call `a` passes to the kernel, in the
    order of their kernel argument fields (launcher._POINTER_FIELDS)."""
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


def plan_signature(kwargs: dict):
    """The dictionary key of a call's plan: each argument's name and, for a tensor, dtype, shape and
    device, for anything else type and value. None when an argument has no cheap one."""
    parts = []
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


class CallPlan:
    """One call signature on one workspace, checked once (see above)."""

    __slots__ = ("names", "device", "scalars", "tensors", "pairs", "fill", "launcher", "kernel",
                 "writes_quant", "writes_scales")

    def __init__(self, ws, launcher, T, a: dict, given: dict):
        """`a`: the checked call with defaults filled in; `given`: the arguments as the caller passed them."""
        order = _pointer_order(a)
        tensors = [name for name in order if isinstance(given.get(name), torch.Tensor)]
        if any(isinstance(v, torch.Tensor) and name not in tensors for name, v in given.items()):
            raise RuntimeError("moe_finalize_allreduce: internal error: a checked call has a tensor the kernel "
                               "does not take")
        self.names = frozenset(given)
        self.device = ws.device
        self.scalars = tuple((name, type(v), v) for name, v in given.items() if not isinstance(v, torch.Tensor))
        # (name, dtype, shape, alignment mask) of each tensor given, in kernel order
        self.tensors = tuple((name, given[name].dtype, tuple(given[name].shape), _ALIGN.get(name, 16) - 1)
                             for name in tensors)
        # The overlap rule (overlaps.overlap_pairs, which the full checks apply too) over the tensors
        # given, as (i, j, bytes of i, bytes of j, tensors[i] may be tensors[j] itself), both non-empty
        # (an empty tensor shares no byte).
        nbytes = [given[name].numel() * given[name].element_size() for name in tensors]
        self.pairs = tuple((i, j, nbytes[i], nbytes[j], in_place and nbytes[i] == nbytes[j])
                           for i, j, in_place in overlap_pairs(tensors) if nbytes[i] and nbytes[j])
        # (position in kernel order, name) of each output the caller did not give: allocated per call
        self.fill = tuple((i, name) for i, name in enumerate(order) if name not in tensors)
        self.launcher = launcher
        self.kernel = launcher.kernel_call(ws, T, a, order) if launcher is not None else None  # None: T is 0
        self.writes_quant = a["quant"] is not None
        self.writes_scales = a["quant"] in ("nvfp4", "fp8_group128")

    def match(self, kw: dict):
        """The data pointers of the call's tensors, in kernel order, when `kw` has this plan's signature
        and passes the checks a signature does not fix (contiguity, alignment, overlap); else None
        (the caller looks further, and the full checks name what is wrong)."""
        if kw.keys() != self.names:
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


class PreparedCall:
    """A checked call: its outputs, and the launch."""

    __slots__ = ("plan", "pointers", "outputs", "args")

    def __init__(self, plan, pointers, args):
        self.plan, self.pointers, self.args = plan, pointers, args
        self.outputs = plan.outputs(args)

    def launch(self) -> MoeFinalizeOutputs:
        return self.plan.run(self.pointers, self.args)
