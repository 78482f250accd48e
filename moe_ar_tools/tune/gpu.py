"""One rank's measurements of a unit, on its GPU, as moe_ar_tools/bench measures a point.

Per unit: random inputs (the same routing, residual and gamma on every rank), their float64
reference (the precision contract: each rank's partial rounded once, the cross-rank sum in float64),
and for every base program of the unit's cell, forced with `program=`: outputs poisoned, eager
warm-up calls, one CUDA graph of `calls` back-to-back calls over the input sets, two replays checked
against the reference (and the ranks' outputs against each other), `reps` timed replays in an order
shuffled per round (the same order on every rank), the outputs of the timed replays checked again.
The replay times stay this rank's: the tune loop takes the slowest rank's (loop.combine_ranks).

A world of one runs through dispatch.LocalWorkspace (no process group); larger worlds through
dispatch.Workspace on the group of one process a GPU (cli.py starts them).
"""
from __future__ import annotations

import hashlib
import math

from generator import spec, tuning

from ..bench.config import (EPS, FALLBACK_L2_BYTES, FP8_PROFILES, FP8_TOLERANCE, NVFP4_TOLERANCE, PROFILES,
                            ROUTED_SCALING_FACTOR, TOLERANCE_U, Shape)
from ..bench.inputs import contract_outputs, make_input_sets, rel_err
from ..bench.outputs import alloc_output_sets, poison
from ..bench.timing import input_sets_for, replay_orders


class RankMeasurer:
    """A rank's workspaces (one per hidden size), inputs and reference of the current shape and T."""

    def __init__(self, *, world_size: int, rank: int, dtype: str, max_tokens: int, reps: int, calls: int,
                 warmup: int, seed: int, timeout_s: float = 30.0, group=None, gloo=None):
        import torch
        self.torch = torch
        self.world_size, self.rank, self.dtype_name = world_size, rank, dtype
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.max_tokens, self.reps, self.calls, self.warmup, self.seed = max_tokens, reps, calls, warmup, seed
        self.timeout_s, self.group, self.gloo = timeout_s, group, gloo
        self.device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)
        self.workspaces: dict = {}
        self.point = None  # (shape, T) of the inputs below
        self.sets = self.refs = None

    # -- agreement over the ranks (CPU collectives; nothing for a world of one) --
    def all_true(self, flag: bool) -> bool:
        if self.gloo is None:
            return flag
        import torch.distributed as dist
        every = self.torch.tensor([1 if flag else 0], dtype=self.torch.int32)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.gloo)
        return bool(every.item())

    def gather(self, obj) -> list:
        if self.gloo is None:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def workspace(self, hidden: int):
        """A workspace of every T up to max_tokens, its one-shot buffer too (every program runs at every T)."""
        import dispatch
        if hidden not in self.workspaces:
            if self.world_size == 1:
                self.workspaces[hidden] = dispatch.LocalWorkspace(max_tokens=self.max_tokens, hidden=hidden,
                                                                  dtype=self.dtype)
            else:
                self.workspaces[hidden] = dispatch.Workspace(self.group, self.max_tokens, hidden, self.dtype,
                                                             timeout_s=self.timeout_s,
                                                             oneshot_max_tokens=self.max_tokens)
        return self.workspaces[hidden]

    def programs(self, unit) -> list[str]:
        """The base programs of the unit's cell: one per rung of the ladder that is not a hole."""
        import dispatch
        have = set(dispatch.programs())
        names = [spec.ProgramSpec(family, unit.dtype, unit.world_size, unit.profile).name
                 for family in dict.fromkeys(tuning.LADDER_FAMILIES) if unit.world_size in spec.world_sizes_of(family)]
        return [name for name in names if name in have]

    # -- inputs and the reference --
    def _inputs(self, unit) -> None:
        from moe_ar_tools import reference as ref
        shape = Shape(unit.hidden, unit.top_k, unit.shared)
        if self.point == (shape, unit.tokens):
            return
        self.sets = self.refs = None
        self.torch.cuda.empty_cache()
        T = unit.tokens
        bytes_per_set = (T * shape.top_k + T * (2 if shape.shared else 1)) * shape.hidden * self.dtype.itemsize
        n_sets = input_sets_for(bytes_per_set, self.l2_bytes, self.calls)
        self.sets = make_input_sets(shape, T, n_sets, self.dtype, self.rank, self.seed, self.device)
        self.refs = [self._reference(x) for x in self.sets]
        amax = max(float(norm.abs().max()) for _, norm in self.refs)
        self.gs_value = ref.f32(ref.E4M3_MAX * 6.0 / amax)  # the usual NVFP4 global scale
        self.gs = self.torch.tensor([self.gs_value], dtype=self.torch.float32, device=self.device)
        self.fp8_scale_value = ref.f32(amax / ref.E4M3_MAX)  # fp8_tensor: the usual static scale
        self.fp8_scale = self.torch.tensor([self.fp8_scale_value], dtype=self.torch.float32, device=self.device)
        self.point = (shape, T)

    def _reference(self, inputs) -> tuple:
        if self.group is not None:
            return contract_outputs(inputs, self.dtype, self.group)
        from moe_ar_tools import reference as ref  # a world of one: the partial is the sum
        partial = ref.finalize_partial(inputs.allreduce_in, inputs.idx, inputs.scale, ROUTED_SCALING_FACTOR,
                                       inputs.shared)
        residual = ref.round_to_dtype(ref.round_to_dtype(partial, self.dtype).double() + inputs.residual.double(),
                                      self.dtype)
        return residual.float(), ref.rmsnorm_f64(residual, inputs.norm_weight, EPS, 0).float()

    # -- one unit --
    def measure(self, unit) -> dict:
        """{program: {"replay_us": [...], "reasons": [...]}} of this rank for every base program of the unit."""
        import dispatch
        torch = self.torch
        self._inputs(unit)
        quant = PROFILES[unit.profile]
        ws = self.workspace(unit.hidden)
        T, H, n_sets = unit.tokens, unit.hidden, len(self.sets)
        ready, results = [], {}
        for name in self.programs(unit):
            outs = alloc_output_sets(T, H, self.dtype, quant, n_sets, self.device)

            def step(i, name=name, outs=outs):
                x = self.sets[i]
                dispatch.moe_finalize_allreduce(
                    ws, allreduce_in=x.allreduce_in, expanded_idx_to_permuted_idx=x.idx, residual_in=x.residual,
                    norm_weight=x.norm_weight, expert_scale_factor=x.scale,
                    routed_scaling_factor=ROUTED_SCALING_FACTOR, shared_expert_output=x.shared, eps=EPS,
                    quant=quant, global_scale=self.gs if quant == "nvfp4" else None,
                    fp8_scale=self.fp8_scale if quant == "fp8_tensor" else None, program=name,
                    **{k: t for k, t in outs[i].items() if quant is not None or k not in ("quant_out", "scale_out")})
            graph, error = self._capture(step, n_sets)
            if not self.all_true(error is None):
                errors = [e for e in self.gather(error) if e]
                results[name] = {"replay_us": [], "reasons": ["could not run or capture: " + "; ".join(errors[:2])]}
                self._reset(ws)
                continue
            ready.append((name, graph, outs))
        for _, graph, outs in ready:  # checked before it is timed: outputs poisoned, then written by replays
            poison(outs)
            graph.replay()
            graph.replay()
        torch.cuda.synchronize(self.device)
        before = {name: self._check(outs, quant) for name, _, outs in ready}
        for _, _, outs in ready:
            poison(outs)
        times = self._timed(ready)
        for (name, _, outs), replay_us in zip(ready, times):
            after = [f"after timing: {why}" for why in self._check(outs, quant)]
            results[name] = {"replay_us": replay_us, "reasons": before[name] + after}
        try:
            ws.check()
            error = None
        except RuntimeError as e:  # a timeout or skipped rows: nothing of this unit is trusted
            error = str(e)
        if not self.all_true(error is None):
            errors = "; ".join(e for e in self.gather(error) if e)
            for got in results.values():
                got["reasons"].append(f"workspace check: {errors}")
            self._reset(ws)
        return results

    def _reset(self, ws) -> None:
        """Back to a clean workspace after a failed program (collective where there is a group)."""
        reset = getattr(ws, "reset", None)
        if reset is not None:
            reset()

    def _capture(self, step, n_sets: int):
        torch = self.torch
        try:
            for i in range(max(self.warmup, n_sets)):
                step(i % n_sets)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for i in range(self.calls):
                    step(i % n_sets)
            torch.cuda.synchronize(self.device)
            return graph, None
        except Exception as e:  # noqa: BLE001 - recorded, the program skipped at this unit on every rank
            return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _check(self, outs: list, quant) -> list[str]:
        """Why the outputs of every input set are not the reference's (empty: they are), on this rank,
        and whether every rank wrote the same bytes."""
        from moe_ar_tools import reference as ref
        tol = TOLERANCE_U * ref.UNIT_ROUNDOFF[self.dtype]
        worst = {"residual_out": 0.0, "norm_out": 0.0, "quant": 0.0}

        def keep(name: str, err: float) -> None:  # the worst error, NaN (a poisoned output) the worst of all
            if math.isnan(err) or err > worst[name]:  # once NaN, no number is larger
                worst[name] = err
        digest = hashlib.sha256()
        for out, (res_ref, norm_ref) in zip(outs, self.refs):
            keep("residual_out", rel_err(out["residual_out"], res_ref))
            keep("norm_out", rel_err(out["norm_out"], norm_ref))
            if quant == "nvfp4":
                rows, cols = out["norm_out"].shape
                deq = ref.nvfp4_dequant(out["quant_out"], out["scale_out"], self.gs_value, rows, cols)
                keep("quant", rel_err(deq, out["norm_out"].float()))
            if quant in FP8_PROFILES:
                scale = (out["scale_out"].repeat_interleave(128, dim=1) if quant == "fp8_group128"
                         else self.fp8_scale_value)
                keep("quant", rel_err(out["quant_out"].float() * scale, out["norm_out"].float()))
            for name in sorted(out):
                digest.update(out[name].reshape(-1).view(self.torch.uint8).cpu().numpy().tobytes())
        reasons = [f"{name} rel err {err:.3g} > {tol:.3g}" for name, err in worst.items()
                   if name != "quant" and not (math.isfinite(err) and err <= tol)]
        limit = NVFP4_TOLERANCE if quant == "nvfp4" else FP8_TOLERANCE
        if quant is not None and not (math.isfinite(worst["quant"]) and worst["quant"] <= limit):
            reasons.append(f"{quant} dequant rel err {worst['quant']:.3g} > {limit}")
        if len(set(self.gather(digest.hexdigest()))) > 1:
            reasons.append("outputs differ across ranks")
        return reasons

    def _timed(self, ready: list) -> list[list[float]]:
        """reps rounds, each graph replayed once a round in a shuffled order (the same on every rank):
        this rank's microseconds a call, [program][replay]."""
        torch = self.torch
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.reps)] for _ in ready]
        for replay, order in enumerate(replay_orders(len(ready), self.reps, self.seed)) if ready else ():
            for j in order:
                start, end = events[j][replay]
                start.record()
                ready[j][1].replay()
                end.record()
        torch.cuda.synchronize(self.device)
        return [[start.elapsed_time(end) * 1e3 / self.calls for start, end in row] for row in events]

    def close(self) -> None:
        for ws in self.workspaces.values():
            ws.close()
        self.workspaces.clear()
