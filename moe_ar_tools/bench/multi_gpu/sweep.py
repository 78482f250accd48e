"""The sweep, per rank: every shape, token count and profile of the run, the result JSON rewritten
after each shape (rank 0), the summary and the plot at the end."""
from __future__ import annotations

import datetime
import os
import pathlib
import socket
import sys
import time
from typing import Optional

from moe_ar_tools.bench.config import (DTYPE_BYTES, EPS, NVFP4_TOLERANCE, REQUIRED_ENV, ROUTED_SCALING_FACTOR,
                                       TOLERANCE_U)
from moe_ar_tools.bench.inputs import contract_outputs, make_input_sets
from moe_ar_tools.bench.multi_gpu.point import PointRunner
from moe_ar_tools.bench.multi_gpu.summary import format_summary, plot, summary_rows
from moe_ar_tools.bench.records import default_out_path, run_header, write_json, write_report
from moe_ar_tools.bench.roofline import measure_bandwidth
from moe_ar_tools.bench.timing import input_sets_for


class Bench(PointRunner):
    """The sweep on this rank: the run's metadata and bandwidth (rank 0), every shape, token count
    and profile, and the JSON and plot (rank 0)."""

    # -- the sweep --
    def run(self) -> Optional[dict]:
        import torch
        cfg = self.cfg
        result = out = bandwidth = None
        if self.rank == 0:
            gpu = torch.cuda.get_device_name(self.device)
            machine = cfg.machine or os.environ.get("MOE_AR_MACHINE") or \
                f"{self.W}x{gpu.replace('NVIDIA ', '').replace(' ', '')}-{socket.gethostname()}"
            now = datetime.datetime.now()
            out = pathlib.Path(cfg.out) if cfg.out else default_out_path(machine, now)
            config = {"shapes": [s.label for s in cfg.shapes], "tokens": cfg.tokens,
                      "profiles": cfg.profiles, "systems": cfg.systems, "reps": cfg.reps,
                      "calls_per_graph": cfg.calls, "warmup": cfg.warmup,
                      "routed_scaling_factor": ROUTED_SCALING_FACTOR, "eps": EPS,
                      "dropped_routes": 0, "expert_scale_factor": "float32",
                      "tolerance": {"rel_u": TOLERANCE_U, "nvfp4_rel": NVFP4_TOLERANCE,
                                    "reference": "float64 (partials rounded to dtype once)"},
                      "l2_bytes": self.l2_bytes, "max_tokens": self.max_tokens,
                      "launch_with_pdl": cfg.pdl, "vec_per_thread": cfg.vec_per_thread}
            result = {"machine": machine, **run_header(gpu=gpu, world_size=self.W, dtype=cfg.dtype, l2_bytes=self.l2_bytes,
                                                   config=config, when=now),
                      "emulated": False, "env": {k: os.environ.get(k) for k in REQUIRED_ENV},
                      "cold_start": cfg.cold_start}
            self.log(f"moe-ar-bench: {machine}, {gpu}, world {self.W}; writing {out}")
            self.log("measuring HBM and peer bandwidth ...")
            bandwidth = measure_bandwidth(self.W, cfg.bw_gib)
        self.barrier()
        self.bandwidth = self.broadcast(bandwidth)
        self.log(f"  HBM {self.bandwidth['hbm_GBps']:.0f} GB/s (copy, read+write), peer "
                 f"{self.bandwidth['nvlink_GBps'] or 0:.0f} GB/s (GPU0 -> GPU1)")
        self.log("compiling / loading programs ...")
        t0 = time.perf_counter()
        compiled = self.compile_programs()
        self.log(f"  {len(compiled)} programs in {time.perf_counter() - t0:.1f} s")
        if self.rank == 0:
            result.update(bandwidth=self.bandwidth, compile=compiled)
        self.result, self.out = result, out

        bar = _SweepProgress(len(cfg.shapes) * len(cfg.tokens) * len(cfg.profiles), self.rank == 0)
        try:
            self.sweep(bar)
        except Exception:
            if self.rank == 0:  # keep what was measured, and why it stopped
                import traceback
                result["error"] = traceback.format_exc()
                self.write(result, out, final=False)
            raise
        bar.close()
        if self.truncated:
            self.log(f"time budget of {cfg.budget_s:.0f} s reached: the sweep stopped early")
        for ws in self.workspaces.values():
            ws.close()
        if self.rank == 0:
            print(self.write(result, out, final=True), flush=True)
            if self.skipped:
                print(f"{len(self.skipped)} skipped (see 'skipped' in the JSON), e.g.:", flush=True)
                for s in self.skipped[:6]:
                    print("  ", s, flush=True)
            print(f"wrote {out} and {out.with_suffix('.summary.txt')}", flush=True)
        return result

    def sweep(self, bar) -> None:
        """Every shape, token count and profile; inputs and the reference are built once per
        shape and token count. Rank 0 rewrites the JSON after each shape."""
        import torch
        from moe_ar_tools import reference as ref
        cfg = self.cfg
        for shape in cfg.shapes:
            for T in cfg.tokens:
                over_budget = time.time() - cfg.started > cfg.budget_s if self.rank == 0 else None
                if self.broadcast(over_budget):  # rank 0 decides, so every rank stops at the same point
                    self.truncated = True
                    break
                bytes_per_set = (T * shape.top_k + T * (2 if shape.shared else 1)) * shape.hidden * \
                    DTYPE_BYTES[cfg.dtype]
                n_sets = input_sets_for(bytes_per_set, self.l2_bytes, cfg.calls)
                sets = make_input_sets(shape, T, n_sets, self.dtype, self.rank, cfg.seed, self.device)
                refs = [contract_outputs(x, self.dtype, self.group) for x in sets]
                amax = max(float(n.abs().max()) for _, n in refs)
                gs_value = ref.f32(ref.E4M3_MAX * 6.0 / amax)  # the usual NVFP4 global scale
                gs = torch.tensor([gs_value], dtype=torch.float32, device=self.device)
                # fp8_tensor: the usual static scale, amax / 448, kept on the device
                self.fp8_scale_value = ref.f32(amax / ref.E4M3_MAX)
                self.fp8_scale = torch.tensor([self.fp8_scale_value], dtype=torch.float32, device=self.device)
                for profile in cfg.profiles:
                    bar.update(f"{shape.label} T={T} p{profile}")
                    self.run_point(shape, T, profile, sets, refs, gs, gs_value)
                del sets, refs
                torch.cuda.empty_cache()
            if self.truncated:
                break
            if self.rank == 0:  # a partial file survives a killed run
                self.write(self.result, self.out, final=False)

    def write(self, result: dict, out: pathlib.Path, final: bool) -> Optional[str]:
        """The JSON; at the end also the summary table beside it (returned) and the plot."""
        result.update(records=self.records, skipped=self.skipped, complete=final and not self.truncated,
                      truncated=self.truncated, wall_s=time.time() - self.cfg.started)
        write_json(out, result)
        if not final:
            return None
        table = format_summary(summary_rows(self.records))
        write_report(out.with_suffix(".summary.txt"), table + "\n", plot, result, out.with_suffix(".png"),
                     log=lambda msg: print(msg, flush=True))
        return table


class _SweepProgress:
    """tqdm on rank 0 when importable, else one printed line per point."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self.n, self.bar = enabled, total, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                # a log file (not a terminal) gets a line every 10 s instead of constant redraws
                self.bar = tqdm(total=total, dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10.0)
            except ImportError:
                pass

    def update(self, desc: str) -> None:
        if not self.enabled:
            return
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(desc)
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total}] {desc}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
