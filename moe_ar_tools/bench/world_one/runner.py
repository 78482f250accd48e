"""World size 1's run: each system captured in a CUDA graph, checked before and after its timed
replays (timing.capture_graph, timing.timed_replays); the floor (the empty kernel, ours at 1 token);
the sweep under the budget; summary.json, records.json, table.md and latency.png written."""
from __future__ import annotations

import time
from typing import Optional

import click

from moe_ar_tools.bench.config import EPS, FP8_TOLERANCE, NVFP4_TOLERANCE, ROUTED_SCALING_FACTOR, TOLERANCE_U
from moe_ar_tools.bench.inputs import rel_err, worst
from moe_ar_tools.bench.records import run_header, write_json, write_report
from moe_ar_tools.bench.roofline import measure_bandwidth, measure_read_bandwidth
from moe_ar_tools.bench.timing import capture_graph, timed_replays
from moe_ar_tools.bench.world_one.config import PROFILES, SYSTEMS, plan
from moe_ar_tools.bench.world_one.report import _us, format_markdown, plot
from moe_ar_tools.bench.world_one.summary import summarize
from moe_ar_tools.bench.world_one.systems import EmptyKernel, Setup, System, _error, dequantize


def tables_used(workspaces: dict) -> dict:
    """{hidden: {set, why}}: the selection tables that chose `ours`' programs on each workspace (a device
    no committed set matches runs the written model)."""
    import dispatch
    return {str(hidden): {key: dispatch.selection_info(ws)[key] for key in ("set", "why")}
            for hidden, ws in sorted(workspaces.items())}


class Runner(Setup):
    """The run on this process's current GPU: capture, check and time the systems at each point, the
    floor, the sweep, the files."""

    # -- capture, check, time --
    def capture(self, system: System) -> Optional[str]:
        """Warm-up calls (the first compiles a compiled system: its time is kept), then one CUDA graph
        of `calls` back-to-back calls. Returns an error string, or None."""
        import torch
        try:
            graph, captured, system.compile_s = capture_graph(
                system.call, self.calls, [j % self.calls for j in range(self.cfg.warmup)], self.device, time_first=True)
            if captured[0] is not None:  # outputs of call j, whose inputs are set j % sets
                system.outputs = list(enumerate(captured))
            system.graph = graph
            return None
        except Exception as e:  # noqa: BLE001 - recorded, the system null at this point
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:  # a sticky CUDA error: the next system's capture reports it too
                pass
            return _error(e)

    def check(self, system: System, profile: str, data: dict) -> list:
        """Reasons the outputs of one replay are wrong (empty: right)."""
        from moe_ar_tools import reference as ref
        p = PROFILES[profile]
        tol = TOLERANCE_U * ref.UNIT_ROUNDOFF[self.dtype]
        n = len(data["sets"])
        errs = {"residual_out": 0.0, "norm_out": 0.0, "quant": 0.0}
        for index, outs in system.outputs:
            res_ref, norm_ref = data["refs"][index % n]
            errs["residual_out"] = worst(errs["residual_out"], rel_err(outs["residual_out"], res_ref))
            if "norm_out" in outs:
                errs["norm_out"] = worst(errs["norm_out"], rel_err(outs["norm_out"], norm_ref))
            if p.quant is not None:
                base = outs["norm_out"].float() if "norm_out" in outs else norm_ref
                deq = dequantize(outs, profile, data["fp8_value"], data["gs_value"])
                errs["quant"] = worst(errs["quant"], rel_err(deq, base))
        q_tol = NVFP4_TOLERANCE if p.quant == "nvfp4" else FP8_TOLERANCE
        reasons = [f"{k} rel err {v:.3g} > {tol:.3g}" for k, v in errs.items() if k != "quant" and not v <= tol]
        if p.quant is not None and not errs["quant"] <= q_tol:
            reasons.append(f"{p.quant} dequant rel err {errs['quant']:.3g} > {q_tol}")
        system.detail["errors"] = {k: v for k, v in errs.items()}
        return reasons

    def checked_replay(self, systems: list, profile: str, data: dict) -> dict:
        import torch
        for s in systems:
            s.prepare()
        for s in systems:
            s.graph.replay()
        torch.cuda.synchronize(self.device)
        return {id(s): self.check(s, profile, data) for s in systems}

    def timed_loop(self, systems: list) -> list:
        """[system][replay]: microseconds per call of the interleaved timed replays (timing.timed_replays)."""
        ms = timed_replays([s.graph for s in systems], self.cfg.reps, self.cfg.seed, self.device)
        return [[t * 1e3 / self.calls for t in row] for row in ms]

    def measure(self, systems: list, profile: str, data: dict, where: dict) -> list:
        """Capture, check, time and check again; returns the records (every system, valid or not)."""
        self.calls = data["calls"]  # calls a graph captures: at least one a cold input set
        records, ready = [], []
        for s in systems:
            err = self.capture(s)
            if s.compile_s is not None and s.compile_s > 1.0 and s.system in ("torch_compile", "flashinfer"):
                self.log(f"    compiled {s.label} in {s.compile_s:.1f} s")
            if err:
                records.append(self.record(system=s.system, variant=s.variant, valid=False,
                                           reason=f"could not run or capture: {err}", **where))
                if s.system in ("torch_compile", "flashinfer"):  # compiling it again at every point costs time
                    self.failed[(s.system, s.variant, where["profile"])] = \
                        f"failed at {where['hidden']}/{where['top_k']} T={where['tokens']}: {err}"
            else:
                ready.append(s)
        before = self.checked_replay(ready, profile, data) if ready else {}
        good = []
        for s in ready:
            if before[id(s)]:
                records.append(self.record(system=s.system, variant=s.variant, valid=False,
                                           reason="wrong result: " + "; ".join(before[id(s)]), program=s.program,
                                           **s.detail, **where))
            else:
                good.append(s)
        times = self.timed_loop(good) if good else []
        after = self.checked_replay(good, profile, data) if good else {}
        for s, replay_us in zip(good, times):
            extra = dict(s.detail, program=s.program, compile_s=s.compile_s, calls_per_graph=self.calls,
                         input_sets=len(data["sets"]), reps=self.cfg.reps)
            if after[id(s)]:
                records.append(self.record(system=s.system, variant=s.variant, valid=False,
                                           reason="wrong result after the timed replays: " + "; ".join(after[id(s)]),
                                           **extra, **where))
            else:
                records.append(self.record(system=s.system, variant=s.variant, valid=True, replay_us=replay_us,
                                           **extra, **where))
        for s in systems:
            s.graph = None
        return records

    # -- the run --
    def floor(self) -> dict:
        """The empty kernel and ours at 1 token (plain, the first shape) with and without PDL, timed together."""
        shape = self.cfg.shapes[0]
        data = self.inputs(shape, 1)
        empty = EmptyKernel(self.device.index)
        systems = [System("empty_kernel", None, lambda j: empty())]
        if "ours" in self.cfg.systems:
            systems += [self.ours(shape, 1, "plain", data, pdl=False, variant="no_pdl"),
                        self.ours(shape, 1, "plain", data, pdl=True, variant="pdl")]
        where = dict(profile="plain", tokens=1, hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared,
                     mode=data["mode"])
        recs = {r["variant"] or r["system"]: r for r in self.measure(systems, "plain", data, where)}
        out = {"shape": shape.label, "records": list(recs.values())}
        for key in ("empty_kernel", "no_pdl", "pdl"):
            rec = recs.get(key)
            out[key] = rec["median_us"] if rec and rec["valid"] else None
        out["program"] = recs.get("no_pdl", {}).get("program")
        return out

    def over_budget(self) -> bool:
        cfg = self.cfg
        return bool(cfg.budget_s) and time.time() - cfg.started + self.longest_point_s > cfg.budget_s

    def sweep(self, header: dict) -> None:
        import torch
        cfg = self.cfg
        total = len(cfg.shapes) * len(cfg.tokens) * len(cfg.profiles) * len(cfg.l2_modes)
        done = 0
        for shape in cfg.shapes:
            for T, mode in ((T, mode) for T in cfg.tokens for mode in cfg.l2_modes):
                data = None
                for profile in cfg.profiles:
                    done += 1
                    where = dict(profile=profile, tokens=T, hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared,
                                 mode=mode)
                    if self.over_budget():
                        self.skipped.append(dict(where, reason=f"budget: {cfg.budget_s:.0f} s"))
                        continue
                    t0 = time.time()
                    data = data or self.inputs(shape, T, mode)
                    systems, nulls = self.build_systems(shape, T, profile, data)
                    recs = nulls + self.measure(systems, profile, data, where)
                    self.records += recs
                    spent = time.time() - t0
                    self.longest_point_s = max(self.longest_point_s, spent)
                    best = {}
                    for r in recs:
                        if r["valid"] and (r["system"] not in best or r["median_us"] < best[r["system"]]):
                            best[r["system"]] = r["median_us"]
                    self.log(f"[{done}/{total}] {shape.label} T={T} {mode} {profile}: " +
                             ", ".join(f"{s} {_us(best.get(s))}" for s in SYSTEMS if s in cfg.systems) +
                             f" us ({spent:.1f} s, {time.time() - cfg.started:.0f} s in)")
                del data
                torch.cuda.empty_cache()
            self.write(header, final=False)  # a killed run keeps what it measured

    def write(self, header: dict, final: bool) -> dict:
        header["wall_s"] = time.time() - self.cfg.started
        summary = summarize(header, self.records, self.skipped, complete=final and not self.skipped)
        for name, obj in (("summary.json", summary), ("records.json", {"records": self.records})):
            write_json(self.out / name, obj)
        if final:
            write_report(self.out / "table.md", format_markdown(summary), plot, summary, self.out / "latency.png",
                         log=self.log)
        return summary

    def run(self) -> dict:
        import torch
        import dispatch
        cfg = self.cfg
        if "ours" in cfg.systems and not hasattr(dispatch, "LocalWorkspace"):
            raise click.ClickException("dispatch.LocalWorkspace is missing: this tree has no world-size-1 runtime")
        gpu = torch.cuda.get_device_name(self.device)
        header = run_header(gpu=gpu, world_size=1, dtype=cfg.dtype, l2_bytes=self.l2_bytes,
                            config=dict(plan(cfg), seed=cfg.seed, warmup=cfg.warmup,
                                        routed_scaling_factor=ROUTED_SCALING_FACTOR, eps=EPS,
                                        tolerance={"rel_u": TOLERANCE_U, "nvfp4_rel": NVFP4_TOLERANCE,
                                                   "fp8_rel": FP8_TOLERANCE}, l2_bytes=self.l2_bytes))
        self.log(f"moe-ar-bench --world 1: {gpu}, commit {header['commit'][:12]}; writing {self.out}")
        bandwidth = measure_bandwidth(1, cfg.bw_gib)
        header.update(bandwidth=bandwidth, copy_gbps=bandwidth["hbm_GBps"])
        self.log(f"  copy {bandwidth['hbm_GBps']:.0f} GB/s (device to device, read + write)")
        read = measure_read_bandwidth(self.device.index, cfg.bw_gib)
        header.update(read_floor=read, read_gbps=read["read_gbps"])
        self.log(f"  read {read['read_gbps']:.0f} GB/s (a streaming-read kernel: the floor)")
        if "ours" in cfg.systems:
            names = sorted({n for p in cfg.profiles for n in self.programs_for(p)})
            t0 = time.perf_counter()
            dispatch.warmup(names, device_index=self.device.index)
            self.log(f"  {len(names)} world-size-1 programs ready in {time.perf_counter() - t0:.1f} s")
        if "flashinfer" in cfg.systems or "chain" in cfg.systems:
            self.load_flashinfer()
        header["flashinfer"] = self.flashinfer_info
        floor = self.floor()
        header.update(empty_kernel_us=floor["empty_kernel"], ours_1_token_us={"no_pdl": floor["no_pdl"], "pdl": floor["pdl"]},
                      floor=floor)
        self.log(f"  empty kernel {_us(floor['empty_kernel'])} us; ours at 1 token {_us(floor['no_pdl'])} us, "
                 f"{_us(floor['pdl'])} us with PDL")
        self.sweep(header)
        header["tables"] = tables_used(self.workspaces)
        summary = self.write(header, final=True)
        for ws in self.workspaces.values():
            if hasattr(ws, "close"):
                ws.close()
        print(format_markdown(summary), flush=True)
        self.log(f"wrote {self.out}/summary.json, records.json, table.md, latency.png")
        return summary
