"""An entry point shaped like FlashInfer's ``flashinfer.comm.trtllm_moe_finalize_allreduce_fusion``,
so that an engine calling FlashInfer for this operation switches with one line:

    from flashinfer.comm import trtllm_moe_finalize_allreduce_fusion              # before
    from dispatch.flashinfer_compat import trtllm_moe_finalize_allreduce_fusion   # after

and passes a dispatch.Workspace where it passed FlashInfer's workspace tensor. Positional order
and names of the arguments are FlashInfer's:

    trtllm_moe_finalize_allreduce_fusion(
        allreduce_in, residual_in, norm_weight, expanded_idx_to_permuted_idx,
        norm_out, residual_out, quant_out, scale_out,
        workspace_ptrs, launch_with_pdl, world_rank, world_size, eps,
        shared_expert_output, expert_scale_factor, routed_scaling_factor, weight_bias=None,
        *, backend="trtllm", global_scale=None)

How each argument maps to dispatch.moe_finalize_allreduce:

    allreduce_in                  allreduce_in [R, H] D, R >= T * top_k
    residual_in                   residual_in [T, H] D (its dtype must be the workspace's)
    norm_weight                   norm_weight [H] D
    expanded_idx_to_permuted_idx  expanded_idx_to_permuted_idx [T, top_k] int32
    norm_out, residual_out        written in place when given; allocated (and returned) when None
    quant_out, scale_out          both None: no quantization; both given: quant="nvfp4", written
                                  in place. quant_out: T * H/2 bytes, e.g. uint8 [T, H/2] (any
                                  contiguous tensor of that many bytes per row is reinterpreted as
                                  uint8); scale_out: at least scale_out_bytes(T, H) bytes, 128x4
                                  swizzled E4M3 (FlashInfer's default SWIZZLED layout)
    workspace_ptrs                a dispatch.Workspace or LocalWorkspace, one rank of an
                                  EmulatedWorld, or a workspace_handle int (not a tensor of pointers)
    launch_with_pdl               launch_with_pdl
    world_rank, world_size        must equal the workspace's rank and world size
    eps                           eps
    shared_expert_output          shared_expert_output [T, H] D or None
    expert_scale_factor           expert_scale_factor [T, top_k] D or float32, or None (= 1)
    routed_scaling_factor         routed_scaling_factor; None means 1.0
    weight_bias                   None or 0.0 -> 0 (RMSNorm with gamma); 1.0 -> 1 (with 1 + gamma)
    backend                       "trtllm" or "auto" (FlashInfer's names; see BACKENDS): both run
                                  this project's kernels
    global_scale (ours)           [1] float32 device tensor, required with quant_out

Anything that cannot be honored raises ValueError naming the argument (a tensor passed as
workspace_ptrs, a rank or world size that is not the workspace's, a weight_bias other than
0/1, only one of quant_out/scale_out, quant_out without global_scale, an unknown backend, an eps
or routed_scaling_factor that is not a finite number (eps > 0), a launch_with_pdl that is not a
bool), as do all of dispatch.moe_finalize_allreduce's own checks (outputs sharing memory with
inputs, among others).

Differences from FlashInfer (as read from its source; see dispatch/API.md):

* Precision. FlashInfer (like TensorRT-LLM) rounds to the activation dtype after every step:
  each scaled expert row is rounded before it is added, the running top_k sum is rounded after
  every add, the shared expert add is rounded, the cross-rank sum is rounded after every add and
  the residual add is rounded again. Here each rank's partial (routed sum times
  routed_scaling_factor plus the shared expert) is accumulated in fp32 and rounded once to the
  dtype (it travels as the dtype over NVLink); the cross-rank sum plus the residual is fp32,
  rounded once; RMSNorm is fp32 from the rounded residual_out. Results are therefore closer to
  the exact value and may differ from FlashInfer's in the last bits (more so for large top_k).
  Every rank's outputs are bit-identical.
* NVFP4 on Hopper. FlashInfer's FP4 conversion is the sm_100 E2M1 convert instruction, compiled
  only for Blackwell (below it the kernel produces no FP4 values); these programs round to E2M1
  in software, the same code on sm_90a (H100/H200) and sm_100a, bit-exact to docs/operation.md
  (round to nearest even, saturating, sign of zero kept). Scale factors use correctly rounded division
  where FlashInfer uses approximate reciprocals, so scale bytes and nibbles can differ from
  FlashInfer's in near-tie blocks.
* Global scale. FlashInfer's finalize entry has no argument for the NVFP4 global scale; here it
  is `global_scale=`, a [1] float32 tensor on the device (read at run time, so a captured CUDA
  graph sees updates).
* Token range. FlashInfer's finalize kernel is one-shot only (it warns above 128 tokens and
  stays one-shot; the payload must fit its Lamport buffer). Here the dispatcher picks one-shot,
  two-shot early or two-shot by T (boundaries in the manifest); two-shot moves 2/W of the
  one-shot NVLink bytes per rank and does 1/W of its cross-rank reduction. T is limited by the
  workspace's max_tokens.
* Workspace. A dispatch.Workspace(group, max_tokens, hidden, dtype) object (collective
  constructor over the given process group, CUDA IPC between ranks, device-side state, a
  timeout on every wait) instead of FlashInfer's workspace tensor of IPC pointers; hidden and
  dtype are fixed per workspace. A peer that does not take part makes the call fail after
  timeout_s with RuntimeError (on the next call or dispatch.check()) instead of hanging;
  recover with reset() on every rank.
* Dropped routes. FlashInfer skips entries equal to -1; here every negative entry is skipped,
  and an entry >= allreduce_in.shape[0] is skipped and reported by Workspace.check().
* expert_scale_factor may be the activation dtype or float32 here, read as its own dtype
  (FlashInfer's kernel reads it as the activation dtype).
* Shapes. World sizes 1 (a LocalWorkspace, world_rank 0, world_size 1: the partial is not rounded
  before the residual add), 2, 4, 8 and 16; hidden a multiple of 16 up to the manifest's
  max_hidden; top_k 1..16; fp16 and bf16.
* Return value. FlashInfer returns None; this returns MoeFinalizeOutputs (the tensors written).
* torch.compile. Called eagerly, this writes the given outputs in place with no copy. Under
  torch.compile it runs the moe_ar custom op (no graph break) and copies its results into the
  given outputs; an engine that wraps the call in its own custom op (as engines do with
  FlashInfer's) runs it eagerly inside that op.
"""
from __future__ import annotations

import numbers
from string import Template
from typing import Optional

import torch

from . import call_arguments
from .call_arguments import ARGUMENTS
from .op import moe_finalize_allreduce
from .outputs import MoeFinalizeOutputs, scale_out_bytes
from .torch_op import as_handle, moe_finalize_allreduce_op, workspace_from_handle

# FlashInfer's finalize entry takes no backend; its unified all-reduce fusion API
# (flashinfer/comm/allreduce.py, create_allreduce_fusion_workspace) names "trtllm", "mnnvl" and "auto".
# This entry stands in for "trtllm" (the TensorRT-LLM kernels its finalize entry runs) and takes "auto";
# "mnnvl" (NVLink multicast kernels) is refused.
BACKENDS = ("trtllm", "auto")

# FlashInfer's flashinfer.comm.trtllm_moe_finalize_allreduce_fusion: its parameters, in its order, with its
# annotations and default; then this entry's own, keyword-only. Every one named as one of the call's
# arguments (call_arguments.ARGUMENTS) is passed on under its name.
FLASHINFER_PARAMETERS = (
    "allreduce_in: torch.Tensor", "residual_in: torch.Tensor", "norm_weight: torch.Tensor",
    "expanded_idx_to_permuted_idx: torch.Tensor", "norm_out: Optional[torch.Tensor]",
    "residual_out: Optional[torch.Tensor]", "quant_out: Optional[torch.Tensor]", "scale_out: Optional[torch.Tensor]",
    "workspace_ptrs", "launch_with_pdl: bool", "world_rank: int", "world_size: int", "eps: float",
    "shared_expert_output: Optional[torch.Tensor]", "expert_scale_factor: Optional[torch.Tensor]",
    "routed_scaling_factor: Optional[float]", "weight_bias: Optional[float] = None")
OWN_PARAMETERS = ('backend: str = "trtllm"', "global_scale: Optional[torch.Tensor] = None")
# The call's arguments this entry sets itself: quant, from quant_out and scale_out (which go on as uint8
# views); weight_bias goes through FlashInfer's rule (_weight_bias), which checks it, not the description's.
_DERIVED = ("quant",)
_PASSED_AS = {"quant_out": "quant_bytes", "scale_out": "scale_bytes"}
_OWN_RULE = ("weight_bias",)


def _workspace(workspace_ptrs):
    if isinstance(workspace_ptrs, torch.Tensor):
        raise ValueError("workspace_ptrs: a FlashInfer workspace tensor cannot be used here; pass a "
                         "dispatch.Workspace(group, max_tokens, hidden, dtype) (or its workspace_handle)")
    if isinstance(workspace_ptrs, int) and not isinstance(workspace_ptrs, bool):
        return workspace_from_handle(workspace_ptrs)
    if workspace_ptrs is None or type(workspace_ptrs).__name__ == "EmulatedWorld" or \
            not hasattr(workspace_ptrs, "world_size") or not hasattr(workspace_ptrs, "hidden"):
        raise ValueError(f"workspace_ptrs: expected a dispatch.Workspace (or world.workspaces[r] of an "
                         f"EmulatedWorld, or a workspace_handle int), got {type(workspace_ptrs).__name__}")
    return workspace_ptrs


def _weight_bias(weight_bias) -> int:
    if weight_bias is None:
        return 0
    if isinstance(weight_bias, bool) or not isinstance(weight_bias, (int, float)) or weight_bias not in (0, 1):
        raise ValueError(f"weight_bias: {weight_bias!r}; supported are None, 0.0 (gamma) and 1.0 (1 + gamma)")
    return int(weight_bias)


def _real(x):
    """A real number that is not a Python one (a NumPy float) as a Python float, for the checks."""
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, int, float)):
        return float(x)
    return x


def _as_bytes(name, buffer, tokens, row_bytes=None, min_bytes=None):
    """A uint8 view of an output buffer FlashInfer would accept: [T, row_bytes] or >= min_bytes flat."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(buffer).__name__}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    nbytes = buffer.numel() * buffer.element_size()
    flat = buffer.reshape(-1).view(torch.uint8)
    if row_bytes is not None:
        if buffer.dim() < 1 or buffer.shape[0] != tokens or nbytes != tokens * row_bytes:
            raise ValueError(f"{name}: shape {tuple(buffer.shape)} {buffer.dtype} ({nbytes} bytes), expected "
                             f"{tokens} rows of {row_bytes} bytes (e.g. uint8 [{tokens}, {row_bytes}])")
        return flat.view(tokens, row_bytes)
    if nbytes < min_bytes:
        raise ValueError(f"{name}: {nbytes} bytes, need at least {min_bytes} (scale_out_bytes(T, H))")
    return flat


# The entry, compiled once from FLASHINFER_PARAMETERS and the description (call_arguments.define): $checks are
# the description's checks of the arguments passed on, $forward passes them on by name, $outputs the outputs.
_ENTRY = Template("""
def trtllm_moe_finalize_allreduce_fusion($parameters) -> MoeFinalizeOutputs:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected one of {BACKENDS} (both run this project's kernels)")
    compiling = torch.compiler.is_compiling()
    # Under torch.compile an int handle is not looked up (the op checks it when it runs).
    ws = None if compiling and isinstance(workspace_ptrs, (int, torch.SymInt)) else _workspace(workspace_ptrs)
    if ws is not None:
        for name, given, want in (("world_rank", world_rank, ws.rank), ("world_size", world_size, ws.world_size)):
            if isinstance(given, bool) or not isinstance(given, int) or given != want:
                raise ValueError(f"{name}: {given!r}, the workspace is rank {ws.rank} of world size {ws.world_size}")
    if (quant_out is None) != (scale_out is None):
        missing = "scale_out" if scale_out is None else "quant_out"
        raise ValueError(f"{missing}: quant_out and scale_out go together (both None: no quantization, "
                         f"both given: NVFP4)")
    quant = None if quant_out is None else "nvfp4"
    if quant is not None and global_scale is None:
        raise ValueError("global_scale: NVFP4 output (quant_out given) needs global_scale=, a [1] float32 tensor on "
                         "the device (FlashInfer's entry has no such argument)")
    if routed_scaling_factor is None:
        routed_scaling_factor = 1.0
    # Numbers pass (a NumPy float too, as a Python float); a bool, a string or a NaN does not.
$checks
    weight_bias = _weight_bias(weight_bias)
    if not isinstance(expanded_idx_to_permuted_idx, torch.Tensor) or expanded_idx_to_permuted_idx.dim() != 2:
        raise ValueError("expanded_idx_to_permuted_idx: expected a [tokens, top_k] int32 tensor")
    T = expanded_idx_to_permuted_idx.shape[0]
    if not isinstance(residual_in, torch.Tensor) or residual_in.dim() != 2:
        raise ValueError("residual_in: expected a [tokens, hidden] tensor")
    H = residual_in.shape[1]
    quant_bytes = scale_bytes = None  # uint8 views of quant_out and scale_out
    if quant is not None:
        if H % 16:
            raise ValueError(f"residual_in: hidden {H} is not a multiple of 16 (NVFP4 blocks)")
        quant_bytes = _as_bytes("quant_out", quant_out, T, row_bytes=H // 2)
        scale_bytes = _as_bytes("scale_out", scale_out, T, min_bytes=scale_out_bytes(T, H))

    if compiling:
        # The custom op (no graph break), then its results into the given outputs.
        out = moe_finalize_allreduce_op(as_handle(workspace_ptrs), $forward)
        norm = out.norm_out if norm_out is None else norm_out.copy_(out.norm_out)
        residual = out.residual_out if residual_out is None else residual_out.copy_(out.residual_out)
        if quant is None:
            return MoeFinalizeOutputs(norm, residual, None, None)
        quant_bytes.copy_(out.quant_out)
        scale_bytes[: out.scale_out.shape[0]].copy_(out.scale_out)
        return MoeFinalizeOutputs(norm, residual, quant_out, scale_out)

    out = moe_finalize_allreduce(ws, $forward, $outputs)
    if quant is None:
        return out
    return MoeFinalizeOutputs(out.norm_out, out.residual_out, quant_out, scale_out)
""")
_ENTRY_DOC = """MoE finalize + all-reduce + residual add + RMSNorm (+ NVFP4) with FlashInfer's argument list.

    See the module docstring for the mapping of every argument and the differences from
    FlashInfer. Outputs given are written in place; the written tensors are returned as
    MoeFinalizeOutputs (quant_out/scale_out None without quantization). Raises ValueError
    naming the argument for anything that cannot be honored, RuntimeError if an earlier call of
    the workspace timed out waiting for a peer.
    """


def define_entry(arguments, namespace: dict):
    """Compile the entry for the call's `arguments` into `namespace` (this module's globals)."""
    names = {text.split(":")[0].split("=")[0].strip() for text in FLASHINFER_PARAMETERS + OWN_PARAMETERS}
    passed = [arg for arg in arguments if arg.name in names or arg.name in _DERIVED]  # in the call's order
    inputs = [arg for arg in passed if not arg.output]
    lines = []
    for arg in inputs:
        if arg.check and arg.name not in _OWN_RULE:
            real = arg.schema == "float"
            lines += [f"    {arg.name} = _real({arg.name})"] * real + [call_arguments.checks([arg], namespace)]
            lines += [f"    {arg.name} = float({arg.name})"] * real
    entry = call_arguments.define(_ENTRY.substitute(
        parameters=", ".join([*FLASHINFER_PARAMETERS, "*", *OWN_PARAMETERS]), checks="\n".join(lines),
        forward=", ".join(f"{arg.name}={arg.name}" for arg in inputs),
        outputs=", ".join(f"{arg.name}={_PASSED_AS.get(arg.name, arg.name)}" for arg in passed if arg.output)),
        namespace, "trtllm_moe_finalize_allreduce_fusion")
    entry.__doc__ = _ENTRY_DOC
    return entry


# help() and inspect show FlashInfer's parameters (a static analyzer sees only the name)
trtllm_moe_finalize_allreduce_fusion = define_entry(ARGUMENTS, globals())
