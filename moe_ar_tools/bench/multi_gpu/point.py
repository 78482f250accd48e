"""One point of the sweep on one rank: build the systems, capture each in a CUDA graph, check the
outputs before and after, time the interleaved replays, make the records."""
from __future__ import annotations

import functools
from typing import Optional

from moe_ar_tools.bench.config import (DTYPE_BYTES, EPS, FP8_PROFILES, FP8_TOLERANCE, NVFP4_TOLERANCE, PROFILES,
                                       ROUTED_SCALING_FACTOR, TOLERANCE_U, Shape)
from moe_ar_tools.bench.inputs import rel_err, worst
from moe_ar_tools.bench.multi_gpu.config import BASELINES, COMPILED_SYSTEMS, SYSTEM_CHOICES, UNFUSED_BASELINES
from moe_ar_tools.bench.multi_gpu.systems import System, torch_epilogue, torch_finalize
from moe_ar_tools.bench.multi_gpu.worker import Worker
from moe_ar_tools.bench.outputs import alloc_output_sets, poison
from moe_ar_tools.bench.records import make_record
from moe_ar_tools.bench.roofline import hbm_bytes, nvlink_bytes, regime_of_family, roofline
from moe_ar_tools.bench.timing import capture_graph, median, pair_ratio, timed_replays
from moe_ar_tools.bench.torch_ops import epilogue_into, finalize_into


class PointRunner(Worker):
    """One point (shape, token count, profile) on this rank: the systems, their CUDA graphs, the
    output checks, the timed loop and the records."""

    # -- systems at one point --
    def build_systems(self, shape: Shape, T: int, profile: str, sets: list, gs) -> list[System]:
        import torch
        import torch.distributed as dist
        import dispatch
        from dispatch.op import profile_for_quant
        quant = PROFILES[profile]
        n_sets, H, device, dtype = len(sets), shape.hidden, self.device, self.dtype
        systems = []
        wanted = set(self.cfg.systems)
        where = dict(hidden=H, top_k=shape.top_k, shared=shape.shared, profile=profile, tokens=T)

        # the unfused baselines: eager torch ops, and the same functions under torch.compile
        flavours = [("torch", finalize_into, epilogue_into)]
        if profile == "plain" and wanted & set(COMPILED_SYSTEMS):
            compiled = self.compiled_for(T, H, sets[0], where)
            if compiled is not None:
                flavours.append(("compiled",) + tuple(compiled))
        for flavour, fin, epi in flavours if profile == "plain" else ():
            if f"nccl+{flavour}" in wanted:
                partial = torch.empty(T, H, dtype=dtype, device=device)
                outs = alloc_output_sets(T, H, dtype, None, n_sets, device)

                def nccl_step(i, partial=partial, outs=outs, fin=fin, epi=epi):
                    torch_finalize(sets[i], partial, fin)
                    dist.all_reduce(partial, group=self.group)
                    torch_epilogue(partial, sets[i], outs[i], epi)
                systems.append(System(f"nccl+{flavour}", "two_shot", nccl_step, outs))

            symm = self.symm_for(H) if f"symm+{flavour}" in wanted else None
            if symm is not None:
                buf = symm.buffer[:T]
                reduced = torch.empty(T, H, dtype=dtype, device=device)
                outs1 = alloc_output_sets(T, H, dtype, None, n_sets, device)
                outs2 = alloc_output_sets(T, H, dtype, None, n_sets, device)

                def symm1_step(i, outs=outs1, buf=buf, reduced=reduced, symm=symm, fin=fin, epi=epi):
                    torch_finalize(sets[i], buf, fin)
                    symm.ops.one_shot_all_reduce_out(buf, "sum", symm.group_name, reduced)
                    torch_epilogue(reduced, sets[i], outs[i], epi)

                def symm2_step(i, outs=outs2, buf=buf, symm=symm, fin=fin, epi=epi):
                    torch_finalize(sets[i], buf, fin)
                    symm.ops.two_shot_all_reduce_(buf, "sum", symm.group_name)
                    torch_epilogue(buf, sets[i], outs[i], epi)
                detail = {"symm_backend": symm.backend}
                name = f"symm+{flavour}"
                systems.append(System(name, "one_shot", symm1_step, outs1, variant="one_shot", detail=detail))
                systems.append(System(name, "two_shot", symm2_step, outs2, variant="two_shot", detail=detail))

        ws = self.workspace(H)

        def fused(program, outs, quant=quant):
            def step(i):
                inputs = sets[i]
                dispatch.moe_finalize_allreduce(
                    ws, allreduce_in=inputs.allreduce_in, expanded_idx_to_permuted_idx=inputs.idx,
                    residual_in=inputs.residual, norm_weight=inputs.norm_weight, expert_scale_factor=inputs.scale,
                    routed_scaling_factor=ROUTED_SCALING_FACTOR, shared_expert_output=inputs.shared, eps=EPS,
                    quant=quant, global_scale=gs if quant == "nvfp4" else None,
                    fp8_scale=self.fp8_scale if quant == "fp8_tensor" else None, program=program,
                    launch_with_pdl=self.cfg.pdl,
                    **{name: t for name, t in outs[i].items()
                       if quant is not None or name not in ("quant_out", "scale_out")})
            return step

        if profile in FP8_PROFILES and "auto+quant" in wanted:
            plain = dispatch.select_program(ws, T, None, shape.shared)
            outs = alloc_output_sets(T, H, dtype, quant, n_sets, device)
            quantize = self.fp8_quant_kernel()
            plain_step = fused(None, outs, quant=None)

            def plus_quant_step(i, outs=outs):
                plain_step(i)
                quantize(outs[i]["norm_out"], outs[i]["quant_out"], outs[i].get("scale_out"),
                         self.fp8_scale if quant == "fp8_tensor" else None)
            family = dispatch.program_info(plain)["family"]
            systems.append(System("auto+quant", regime_of_family(family), plus_quant_step, outs, program=plain))

        if "auto" in wanted:
            chosen = dispatch.select_program(ws, T, quant, shape.shared)
            family = dispatch.program_info(chosen)["family"]
            outs = alloc_output_sets(T, H, dtype, quant, n_sets, device)
            systems.append(System("auto", regime_of_family(family), fused(None, outs), outs, program=chosen))

        forced = [n for n in self.cfg.systems if n not in SYSTEM_CHOICES]
        if "programs" in wanted:
            forced = self.programs_for(profile)
        for name in forced:
            info = dispatch.program_info(name)
            if (info["dtype"], info["world_size"], info["profile"]) != (self.cfg.dtype, self.W,
                                                                        profile_for_quant(quant)):
                continue
            if info["family"] == "oneshot" and T > ws.oneshot_max_tokens:
                self.skip(f"one-shot above the workspace's oneshot_max_tokens {ws.oneshot_max_tokens}",
                          system=name, **where)
                continue
            outs = alloc_output_sets(T, H, dtype, quant, n_sets, device)
            systems.append(System(name, regime_of_family(info["family"]), fused(name, outs), outs, program=name))
        return systems

    def capture(self, system: System, n_sets: int) -> Optional[str]:
        """Eager warm-up calls, then one CUDA graph of `calls` back-to-back calls rotating over
        the input sets. Returns an error string, or None."""
        try:
            system.graph, _, _ = capture_graph(lambda i: system.call(i % n_sets), self.cfg.calls,
                                               range(max(self.cfg.warmup, n_sets)), self.device)
            return None
        except Exception as e:  # noqa: BLE001 - recorded and the system skipped at this point
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def check(self, system: System, refs: list, gs_value: Optional[float], quant) -> dict:
        """Compare every input set's outputs with the float64 reference and across ranks."""
        import torch
        from moe_ar_tools import reference as ref
        tol = TOLERANCE_U * ref.UNIT_ROUNDOFF[self.dtype]
        res_err = norm_err = q_err = 0.0
        identical = True
        for outs, (res_ref, norm_ref) in zip(system.outputs, refs):
            res_err = worst(res_err, rel_err(outs["residual_out"], res_ref))
            norm_err = worst(norm_err, rel_err(outs["norm_out"], norm_ref))
            if quant == "nvfp4":
                T, H = outs["norm_out"].shape
                deq = ref.nvfp4_dequant(outs["quant_out"], outs["scale_out"], gs_value, T, H)
                q_err = worst(q_err, rel_err(deq, outs["norm_out"].float()))
            if quant in FP8_PROFILES:
                deq = outs["quant_out"].float() * (outs["scale_out"].repeat_interleave(128, dim=1)
                                                   if quant == "fp8_group128" else self.fp8_scale_value)
                q_err = worst(q_err, rel_err(deq, outs["norm_out"].float()))
            for tensor in outs.values():  # bit identity across ranks
                mine = tensor.reshape(-1).view(torch.uint8)
                identical &= bool((self.all_gather(mine) == mine).all())
        reasons = []  # `not err <= tol`: a NaN error fails
        if not res_err <= tol:
            reasons.append(f"residual_out rel err {res_err:.3g} > {tol:.3g}")
        if not norm_err <= tol:
            reasons.append(f"norm_out rel err {norm_err:.3g} > {tol:.3g}")
        if quant == "nvfp4" and not q_err <= NVFP4_TOLERANCE:
            reasons.append(f"nvfp4 dequant rel err {q_err:.3g} > {NVFP4_TOLERANCE}")
        if quant in FP8_PROFILES and not q_err <= FP8_TOLERANCE:
            reasons.append(f"fp8 dequant rel err {q_err:.3g} > {FP8_TOLERANCE}")
        if not identical:
            reasons.append("outputs differ across ranks")
        return {"residual_rel_err": res_err, "norm_rel_err": norm_err,
                "nvfp4_rel_err": q_err if quant == "nvfp4" else None,
                "fp8_rel_err": q_err if quant in FP8_PROFILES else None, "identical": identical, "reasons": reasons}

    def agree_checks(self, local: dict) -> dict:
        """Merge the ranks' check results: worst errors, all reasons."""
        every = self.gather(local)
        merged = {"reasons": sorted({f"rank {r}: {why}" for r, checks in enumerate(every)
                                     for why in checks["reasons"]})}
        for key in ("residual_rel_err", "norm_rel_err", "nvfp4_rel_err", "fp8_rel_err"):
            vals = [checks[key] for checks in every if checks[key] is not None]
            merged[key] = functools.reduce(worst, vals) if vals else None
        return merged

    def timed_loop(self, systems: list[System]) -> list[list[float]]:
        """The interleaved timed replays (timing.timed_replays) on this rank; after the loop, the
        per-replay times of all ranks are gathered and the maximum taken (the slowest rank). Returns
        [system][replay] microseconds per call."""
        import torch
        ms = torch.tensor(timed_replays([s.graph for s in systems], self.cfg.reps, self.cfg.seed, self.device),
                          dtype=torch.float64, device=self.device)
        per_call_us = self.all_gather(ms).amax(0) * 1e3 / self.cfg.calls
        return per_call_us.tolist()

    # -- one point --
    def run_point(self, shape: Shape, T: int, profile: str, sets: list, refs: list, gs, gs_value) -> None:
        import torch
        quant = PROFILES[profile]
        where = dict(hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared, profile=profile, tokens=T)
        systems = self.build_systems(shape, T, profile, sets, gs)
        ready = []
        for system in systems:
            err = self.capture(system, len(sets))
            if self.all_true(err is None):
                ready.append(system)
            else:
                errs = [e for e in self.gather(err) if e]
                self.skip("could not run or capture: " + "; ".join(errs[:2]), system=system.label, **where)
                system.graph = None
                if system.program is not None:  # a fused program failed: bring its workspace back to a clean state
                    self.workspace(shape.hidden).reset()
        if not ready:
            return
        for system in ready:  # before: outputs poisoned, then written by graph replays
            poison(system.outputs)
        for _ in range(2):
            for system in ready:
                system.graph.replay()
        torch.cuda.synchronize(self.device)
        for system in ready:
            system.checks["before"] = self.agree_checks(self.check(system, refs, gs_value, quant))
            poison(system.outputs)
        times = self.timed_loop(ready)
        for system in ready:  # after: what the timed replays wrote
            system.checks["after"] = self.agree_checks(self.check(system, refs, gs_value, quant))
        self.records_for(shape, T, profile, ready, times, len(sets))
        for system in ready:
            system.graph = None
        if any(system.program for system in ready):
            self.check_workspace(shape.hidden, where)

    def check_workspace(self, hidden: int, where: dict) -> None:
        """A kernel that timed out or skipped out-of-range rows leaves a mark in the workspace;
        record it and bring every rank's workspace back to a clean state."""
        ws = self.workspace(hidden)
        try:
            ws.check()
            err = None
        except RuntimeError as e:
            err = str(e)
        if not self.all_true(err is None):
            self.skip("workspace check after the point: " + "; ".join(e for e in self.gather(err) if e), **where)
            ws.reset()

    def records_for(self, shape: Shape, T: int, profile: str, systems: list, times: list, n_sets: int) -> None:
        if self.rank != 0:
            return
        import dispatch
        elem = DTYPE_BYTES[self.cfg.dtype]
        hbm = hbm_bytes(T, shape.hidden, shape.top_k, shape.shared, profile, elem)
        valid = {id(s): not (s.checks["before"]["reasons"] or s.checks["after"]["reasons"]) for s in systems}
        med = {id(s): median(replay_us) for s, replay_us in zip(systems, times)}
        series = {id(s): replay_us for s, replay_us in zip(systems, times)}

        def best(pred):
            cands = [s for s in systems if pred(s) and valid[id(s)]]
            return min(cands, key=lambda s: med[id(s)]) if cands else None
        nccl = best(lambda s: s.name == "nccl+torch")
        symm = best(lambda s: s.name == "symm+torch")
        nccl_c = best(lambda s: s.name == "nccl+compiled")
        symm_c = best(lambda s: s.name == "symm+compiled")
        base = best(lambda s: s.name in UNFUSED_BASELINES)  # the strongest unfused baseline here
        prog = best(lambda s: s.name not in ("auto",) + BASELINES)
        plus_quant = best(lambda s: s.name == "auto+quant")
        # auto at the plain profile at this point (measured in its own leg, before this one)
        plain_auto = next((r["median_us"] for r in self.records if r["system"] == "auto" and r["valid"]
                           and r["profile"] == "plain" and (r["hidden"], r["top_k"], r["shared"], r["tokens"])
                           == (shape.hidden, shape.top_k, shape.shared, T)), None)
        # NVFP4 has no torch baseline; the plain unfused step at this point, timed in
        # its own leg, tells what the fused step with quantization costs against it.
        plain_nccl = next((r["median_us"] for r in self.records if r["system"] == "nccl+torch" and r["valid"]
                           and r["profile"] == "plain" and (r["hidden"], r["top_k"], r["shared"], r["tokens"])
                           == (shape.hidden, shape.top_k, shape.shared, T)), None)
        bandwidth = self.bandwidth
        for system, replay_us in zip(systems, times):
            nvlink = nvlink_bytes(T, shape.hidden, self.W, system.regime, elem)
            roof = roofline(hbm["total"], nvlink, bandwidth["hbm_GBps"], bandwidth["nvlink_GBps"] or float("inf"))
            extra = {}
            for key, other in (("ratio_vs_nccl_torch", nccl), ("ratio_vs_symm_torch", symm),
                               ("ratio_vs_nccl_compiled", nccl_c), ("ratio_vs_symm_compiled", symm_c),
                               ("ratio_vs_best_baseline", base),
                               ("ratio_vs_best_program", prog), ("ratio_vs_auto_plus_quant", plus_quant)):
                if other is not None and other is not system:
                    extra[key] = pair_ratio(replay_us, series[id(other)])
                elif other is system:
                    extra[key] = 1.0
            if profile != "plain" and plain_nccl is not None:
                extra["ratio_of_medians_vs_nccl_torch_plain"] = med[id(system)] / plain_nccl
            if profile != "plain" and plain_auto is not None:
                extra["ratio_of_medians_vs_auto_plain"] = med[id(system)] / plain_auto
            if prog is not None:
                extra["best_program"] = prog.name
            if symm is not None:
                extra["symm_variant"] = symm.variant
            if symm_c is not None:
                extra["symm_compiled_variant"] = symm_c.variant
            if base is not None:
                extra["best_baseline"] = base.label
            extra.update(system.detail)
            if system.variant:
                extra["variant"] = system.variant
            if system.program:
                extra["program"] = system.program
                extra["family"] = dispatch.program_info(system.program)["family"]
            reasons = system.checks["before"]["reasons"] + \
                [f"after: {why}" for why in system.checks["after"]["reasons"]]
            self.records.append(make_record(
                system=system.name, world_size=self.W, dtype=self.cfg.dtype, hidden=shape.hidden, top_k=shape.top_k,
                shared=shape.shared, profile=profile, tokens=T, replay_us=replay_us,
                roofline_us=roof["roofline_us"], valid=valid[id(system)], regime=system.regime,
                roofline_fraction=roof["roofline_us"] / med[id(system)], bound=roof["bound"],
                hbm_bytes=hbm["total"], nvlink_bytes=nvlink, hbm_us=roof["hbm_us"], nvlink_us=roof["nvlink_us"],
                reps=self.cfg.reps, calls_per_graph=self.cfg.calls, input_sets=n_sets,
                errors={"before": {k: v for k, v in system.checks["before"].items() if k != "reasons"},
                        "after": {k: v for k, v in system.checks["after"].items() if k != "reasons"}},
                **({"invalid_reason": "; ".join(reasons)} if reasons else {}), **extra))
