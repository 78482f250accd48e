"""The call: check the arguments, pick the program, launch it on torch's current stream.

The launch path does no device allocation (unless outputs are not passed in, when it takes them
from torch's caching allocator, as any torch op does), no synchronization and no hashing of
sources: programs are compiled and their launch state built once, at a workspace's first call
of each program (or ahead of time with dispatch.warmup).

The parts, one concern each: call_arguments.py (the full checks of a call), overlaps.py (which
tensors may share memory), outputs.py (their shapes and allocation), call_plan.py (the plan of a
call signature: the short path), launcher.py (a program's launch state and cuLaunchKernelEx).
"""
from __future__ import annotations

from . import registry, shape_constants
from .call_arguments import CALL_DEFAULTS, MAX_TOP_K, REQUIRED, call_signature, check_call_arguments, profile_for_quant
from .call_plan import CallPlan, PreparedCall, plan_signature
from .launcher import launcher_for
from .outputs import FP8_GROUP, MoeFinalizeOutputs, allocate_outputs, fp8_scale_shape, scale_out_bytes

# The call's public names, importable from here as before (the package's API, the tools, users).
__all__ = ["FP8_GROUP", "MoeFinalizeOutputs", "fp8_scale_shape", "moe_finalize_allreduce", "prepare_call",
           "profile_for_quant", "scale_out_bytes", "select_program"]


def _not_a_workspace(name: str, value) -> str:
    return f"{name}: {value!r} is not a dispatch workspace (Workspace, LocalWorkspace or an EmulatedWorld rank's)"


def select_program(ws, tokens: int, quant=None, has_shared: bool = False, top_k: int | None = None) -> str:
    """The program the dispatcher runs on this rank for a call of `tokens` tokens with `quant`
    (None, "nvfp4", "fp8_group128" or "fp8_tensor") and, when `has_shared`, a shared-expert operand.
    Raises ValueError for a bad `quant` or `top_k`, or ("program: ...") when no program covers the cell.
    At world size 1 the latency program's range also ends at the tokens its blocks run in one wave,
    a block a token, on this workspace's GPU, and, for a call of `top_k` routes (None: the table
    alone) that the streaming program runs as its few-routes build, at
    shape_constants.FEW_ROUTES_LATENCY_MAX_TOKENS (so asking may load either program, as a call would)."""
    if not all(hasattr(ws, name) for name in ("dtype_name", "world_size", "oneshot_max_tokens", "selection")):
        raise ValueError(_not_a_workspace("ws", ws))
    if top_k is not None and (type(top_k) is not int or not 1 <= top_k <= MAX_TOP_K):
        raise ValueError(f"top_k: {top_k!r}, expected None or an int in 1..{MAX_TOP_K}")
    profile = profile_for_quant(quant)
    bounds = ws.selection.limits(profile)
    family = registry.select_family(ws.dtype_name, ws.world_size, profile, tokens, has_shared, ws.oneshot_max_tokens,
                                    bounds=bounds)
    name = registry.program_for(family, ws.dtype_name, ws.world_size, profile)
    if registry.program_info(name)["regime"] != registry.LOCAL_LATENCY_REGIME:
        return name
    tokens = max(tokens, 1)
    # world size 1's latency program past its one wave of blocks (a hidden size the table did not
    # measure can put its byte boundary there), or past where the few-routes build is faster: the next rung
    past_wave = tokens > launcher_for(ws, name).one_wave_tokens()
    if past_wave or (top_k is not None and tokens > shape_constants.FEW_ROUTES_LATENCY_MAX_TOKENS):
        family = registry.select_family(ws.dtype_name, ws.world_size, profile, tokens, has_shared,
                                        ws.oneshot_max_tokens, bounds={**bounds, registry.LOCAL_LATENCY_FIELD: 0})
        after = registry.program_for(family, ws.dtype_name, ws.world_size, profile)
        if past_wave or launcher_for(ws, after).takes_few_routes(top_k):
            name = after
    return name


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
    try:
        state = workspace._moe_ar_state  # the package's state of the workspace (workspace_state.py)
        recent = state.recent_plans
    except AttributeError:  # not a workspace: a check that costs the launch path nothing
        raise ValueError(_not_a_workspace("workspace", workspace)) from None
    if recent and not recent[0].fill:  # the short path of prepare_call, without a PreparedCall
        state.ensure_callable()
        plan = recent[0]
        pointers = plan.match(kwargs)
        if pointers is not None:
            return plan.run(pointers, kwargs)
    return prepare_call(workspace, kwargs).launch()


# help(), inspect and an IDE that asks the running interpreter see every keyword with its default (the
# description in call_arguments). The function itself takes **kwargs: spelled-out parameters measured
# slower on the launch path (every default then enters the call's arguments and its plan).
moe_finalize_allreduce.__signature__ = call_signature()


_PLANS_PER_WORKSPACE = 1024  # a workspace drops its plans past this many signatures
_RECENT_PLANS = 4  # plans matched before any signature is built, most recently used first
_KNOWN = frozenset(CALL_DEFAULTS) | frozenset(REQUIRED)


def prepare_call(workspace, kwargs: dict) -> PreparedCall:
    """Everything of a call but the launch: checks, outputs, program choice (compiling it at first use).
    `kwargs` (the call's keyword arguments) gets the allocated outputs."""
    try:
        state = workspace._moe_ar_state
        recent = state.recent_plans
    except AttributeError:
        raise ValueError(_not_a_workspace("workspace", workspace)) from None
    state.ensure_callable()
    for i, plan in enumerate(recent):
        pointers = plan.match(kwargs)
        if pointers is not None:
            if i:
                recent.insert(0, recent.pop(i))
            break
    else:
        plan, pointers = _plan_for(workspace, state.plans, kwargs)
        recent.insert(0, plan)
        del recent[_RECENT_PLANS:]
    if plan.fill:
        allocate_outputs(workspace, kwargs)
        pointers = plan.with_outputs(pointers, kwargs)
    return PreparedCall(plan, pointers, kwargs)


def _plan_for(workspace, plans: dict, kwargs: dict):
    """(plan, data pointers) of a call that matched none of the workspace's recent plans: its
    signature's plan in `plans` (the workspace's), or a new one after the full checks."""
    signature = plan_signature(kwargs)
    plan = plans.get(signature) if signature is not None else None
    pointers = plan.match(kwargs) if plan is not None else None
    if pointers is None:
        plan = _full_checks(workspace, kwargs)
        pointers = plan.match(kwargs)
        if pointers is None:  # cannot happen after the full checks passed
            raise RuntimeError("moe_finalize_allreduce: internal error: a checked call failed its plan's checks")
        if signature is not None:
            if len(plans) >= _PLANS_PER_WORKSPACE:
                plans.clear()
            plans[signature] = plan
    return plan, pointers


def _full_checks(workspace, kwargs: dict) -> CallPlan:
    """Every check of a call (ValueError naming the argument), and the plan for its signature."""
    unknown = set(kwargs) - _KNOWN
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown argument")
    for name in REQUIRED:
        if name not in kwargs:
            raise ValueError(f"{name}: required")
    a = dict(CALL_DEFAULTS)
    a.update(kwargs)
    T, K, R, profile = check_call_arguments(workspace, a)
    if T == 0:
        return CallPlan(workspace, None, T, a, kwargs)
    name = a["program"]
    if name is None:
        name = select_program(workspace, T, a["quant"], a["shared_expert_output"] is not None, top_k=K)
    launcher = launcher_for(workspace, name)
    if launcher.profile != profile:
        raise ValueError(f"program: {name} writes output profile {launcher.profile}, the call asks for {profile}")
    if launcher.regime == registry.ONESHOT_REGIME and T > workspace.oneshot_max_tokens:
        raise ValueError(f"program: one-shot {name} at {T} tokens exceeds the workspace's oneshot_max_tokens "
                         f"{workspace.oneshot_max_tokens}")
    return CallPlan(workspace, launcher, T, a, kwargs)
