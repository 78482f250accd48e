"""World size 1: ours against the best unfused chains on one GPU.

    moe-ar-bench-one --out DIR          (or python -m moe_ar_tools.bench_world_one; --dry-run: the plan only)

One GPU, every system in one run. DIR gets summary.json (one row per point, the targets checked),
records.json (every system's replay times), latency.png (latency against tokens, log-log, one
panel per profile, the target shape) and table.md (the short table bench_results/world_size_1/
shows). The operation: finalize (top-k rows x router weights x routed_scaling_factor + shared
expert) + residual add + RMSNorm + an optional quantization, residual_out rounded once.

Systems at each point (shape, token count T, output profile):
  ours           dispatch.moe_finalize_allreduce on a dispatch.LocalWorkspace (world size 1), the
                 automatic choice (`program` says which); where a cell has more than one world-size-1
                 program, each is also forced (`programs`)
  torch_eager    baselines/torch_chain.py: gather + weighted sum + shared + add + torch's rms_norm +
                 the quantization in torch (NVFP4 with 128x4 swizzled scales, FP8 group-128 row / column
                 scales, FP8 per-tensor), captured in a CUDA graph
  torch_compile  the same under torch.compile (inductor), compiled with dynamic shapes (once for every
                 T; every shape) and per T (static, as engines capture fixed sizes; --static-compile-shapes,
                 the target shape by default); the faster per point, `compile_mode` says which
  flashinfer     the compiled torch finalize (the faster mode) then FlashInfer's fused_add_rmsnorm
                 (plain) or fused_add_rmsnorm_quant (fp8_tensor: FP8 only, it writes no bf16 norm_out), in
                 place on the residual as engines call them, with FlashInfer's default PDL; null with the
                 reason where FlashInfer has no such kernel on the GPU (NVFP4: sm_100+ only; FP8
                 per-token-group: none) or its kernels are not at hand (baselines/flashinfer_norm.py)

Floor, measured in the same run: the device-to-device copy bandwidth (read + write counted,
moe_ar_tools.bench.measure_bandwidth), an empty kernel timed like every system (graph replays of
back-to-back empty kernels), ours at 1 token (target shape, plain) with and without PDL.

Timing (docs/measurement.md on one GPU): each system's calls are captured in one CUDA graph of
--calls back-to-back calls rotating over input sets that together exceed twice the L2; the graphs
are replayed --reps rounds (at least 50), every system once a round in an order shuffled per round;
a point's time is the median replay / calls; ratios are medians of per-round ratios (baseline /
ours: above 1, ours is faster).

Correctness, before timing and again after it, every system: residual_out and norm_out against the
float64 reference of the world-size-1 contract (residual_out = D(partial + residual_in), rounded
once; RMSNorm in float64) within TOLERANCE_U units of roundoff (norm-relative), quantized outputs
dequantized against the system's own norm_out (the reference's where it writes none); outputs
are poisoned first. A wrong result voids the system at that point (null, with the reason).

Roofline: the bytes the operation must move (hbm_bytes_ws1: expert rows, routing, shared expert,
residual and gamma read, outputs, quantized outputs and scales written) over the copy bandwidth.
Targets (check_targets): >= 88% of the copy bandwidth from 2,048 tokens for plain and FP8 (NVFP4
>= 85%), never slower than any baseline, geometric mean over T of the speed-up over the fastest
baseline >= 2, and at 1 token at most twice the empty kernel.

--budget-s: no point starts when the longest point so far would end past it; what is left is
recorded as skipped. The pure-Python parts (options, bytes, summary, targets, table) are at the top
and tested on CPU (tests/test_bench_world_one_cpu.py); the GPU parts below import lazily.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import click

from moe_ar_tools import bench
from moe_ar_tools.bench import (DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPE_BYTES, EPS, FP8_TOLERANCE, NVFP4_TOLERANCE,
                                ROUTED_SCALING_FACTOR, TOLERANCE_U, Shape, median, pair_ratio, parse_list,
                                parse_shapes, parse_tokens, percentile)
from moe_ar_tools.provenance import git_commit

SYSTEMS = ("ours", "torch_eager", "torch_compile", "flashinfer")
BASELINES = SYSTEMS[1:]
COMPILE_MODES = ("dynamic", "static")
# a record's system: one of SYSTEMS, a forced program ("program", its name the variant), the floor's empty kernel
RECORD_SYSTEMS = SYSTEMS + ("program", "empty_kernel")
TARGET_SHAPE = Shape(7168, 8, True)


@dataclass(frozen=True)
class Profile:
    """An output profile: dispatch's quant= and fp8_scale_layout=, and moe_ar_tools.bench's profile name
    for the byte count."""
    name: str
    quant: Optional[str]
    scale_layout: Optional[str]
    bench_profile: str


PROFILES = {p.name: p for p in (
    Profile("plain", None, None, "110"),
    Profile("nvfp4", "nvfp4", None, "111"),
    Profile("fp8_group128_row", "fp8_group128", "row", "fp8_group128"),
    Profile("fp8_group128_col", "fp8_group128", "column", "fp8_group128"),
    Profile("fp8_tensor", "fp8_tensor", None, "fp8_tensor"),
)}

# The targets (check_targets)
BANDWIDTH_FROM_TOKENS = 2048
BANDWIDTH_TARGET = {"plain": 0.88, "nvfp4": 0.85, "fp8_group128_row": 0.88, "fp8_group128_col": 0.88,
                    "fp8_tensor": 0.88}
SPEEDUP_GEOMEAN_TARGET = 2.0
ONE_TOKEN_EMPTY_KERNELS = 2.0

DEFAULT_BUDGET_S = 480.0


# ---- options -----------------------------------------------------------------------------------

@dataclass
class Config:
    shapes: list
    tokens: list
    profiles: list
    systems: list
    compile_modes: list
    static_compile_shapes: list
    dtype: str = "bf16"
    reps: int = 50
    calls: int = 10
    warmup: int = 3
    budget_s: float = DEFAULT_BUDGET_S   # 0: none
    out: Optional[str] = None
    seed: int = 1234
    bw_gib: float = 2.0
    flashinfer_dir: Optional[str] = None
    programs: bool = True                 # force every world-size-1 program where a cell has several
    started: float = field(default_factory=time.time)

    def static_compile(self, shape: Shape) -> bool:
        return "static" in self.compile_modes and shape in self.static_compile_shapes


def make_config(*, shapes=DEFAULT_SHAPES, tokens=DEFAULT_TOKENS, profiles=",".join(PROFILES),
                systems=",".join(SYSTEMS), compile_modes=",".join(COMPILE_MODES),
                static_compile_shapes="7168:8:shared", dtype="bf16", reps=50, calls=10, warmup=3,
                budget_s=DEFAULT_BUDGET_S, **rest) -> Config:
    """The options as a Config; ValueError naming the option that is wrong."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    for name, value, least in (("reps", reps, 1), ("calls", calls, 1), ("warmup", warmup, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} {value!r}: expected an int >= {least}")
    if not isinstance(budget_s, (int, float)) or budget_s < 0 or not math.isfinite(budget_s):
        raise ValueError(f"budget_s {budget_s!r}: expected seconds >= 0 (0: no budget)")
    return Config(shapes=parse_shapes(shapes), tokens=parse_tokens(tokens),
                  profiles=parse_list(profiles, tuple(PROFILES), "profile"),
                  systems=parse_list(systems, SYSTEMS, "system"),
                  compile_modes=parse_list(compile_modes, COMPILE_MODES, "compile mode"),
                  static_compile_shapes=parse_shapes(static_compile_shapes) if static_compile_shapes else [],
                  dtype=dtype, reps=reps, calls=calls, warmup=warmup, budget_s=float(budget_s), **rest)


def plan(cfg: Config) -> dict:
    """What a run measures and compiles (the --dry-run output)."""
    points = len(cfg.shapes) * len(cfg.tokens) * len(cfg.profiles)
    compiles = {"dynamic": 0, "static": 0}
    if "torch_compile" in cfg.systems or "flashinfer" in cfg.systems:
        if "dynamic" in cfg.compile_modes:
            # one graph per profile and shared-expert presence, a second one where T = 1 (size-1 specialization)
            variants = {(p, s.shared, t == 1) for s in cfg.shapes for p in cfg.profiles for t in cfg.tokens}
            compiles["dynamic"] = len(variants) * ("torch_compile" in cfg.systems) + \
                len({(s.shared, t == 1) for s in cfg.shapes for t in cfg.tokens}) * ("flashinfer" in cfg.systems)
        static_shapes = [s for s in cfg.shapes if cfg.static_compile(s)]
        compiles["static"] = len(static_shapes) * len(cfg.tokens) * \
            (len(cfg.profiles) * ("torch_compile" in cfg.systems) + ("flashinfer" in cfg.systems))
    return {"points": points, "shapes": [s.label for s in cfg.shapes], "tokens": cfg.tokens, "profiles": cfg.profiles,
            "systems": cfg.systems, "compile_modes": cfg.compile_modes,
            "static_compile_shapes": [s.label for s in cfg.static_compile_shapes], "compiles": compiles,
            "reps": cfg.reps, "calls": cfg.calls, "budget_s": cfg.budget_s}


# ---- bytes and roofline ------------------------------------------------------------------------

def hbm_bytes_ws1(tokens: int, hidden: int, top_k: int, shared: bool, profile: str, elem_bytes: int = 2) -> dict:
    """Bytes the operation must move through HBM, by term: moe_ar_tools.bench.hbm_bytes (expert rows,
    routing, shared expert, residual, gamma, residual_out and norm_out, quantized outputs and scales)
    with the column-major FP8 scales counted as laid out, [H/128, roundup(T, 4)] float32."""
    from dispatch.op import fp8_scale_shape
    p = PROFILES[profile]
    terms = bench.hbm_bytes(tokens, hidden, top_k, shared, p.bench_profile, elem_bytes)
    if p.scale_layout == "column":
        groups, padded = fp8_scale_shape(tokens, hidden, "column")
        extra = (groups * padded - tokens * groups) * 4
        terms["fp8"] += extra
        terms["total"] += extra
    return terms


def roofline_us(total_bytes: float, copy_gbps: float) -> float:
    """Microseconds to move `total_bytes` at the copy bandwidth (GB/s, read + write counted)."""
    return total_bytes / (copy_gbps * 1e3)


# ---- records, summary, targets -----------------------------------------------------------------

def make_record(*, system: str, profile: str, tokens: int, hidden: int, top_k: int, shared: bool,
                valid: bool, replay_us=None, variant: Optional[str] = None, reason: Optional[str] = None,
                **extra) -> dict:
    """One system (one variant: a compile mode, a forced program) at one point. A valid record carries
    its per-replay times (microseconds per call) and their median; an invalid one the reason."""
    if system not in RECORD_SYSTEMS:
        raise ValueError(f"record: system {system!r}")
    if profile not in PROFILES:
        raise ValueError(f"record: profile {profile!r}")
    if valid and not replay_us:
        raise ValueError("record: a valid record needs replay_us")
    if not valid and not reason:
        raise ValueError("record: an invalid record needs the reason")
    rec = {"system": system, "variant": variant, "profile": profile, "tokens": int(tokens), "hidden": int(hidden),
           "top_k": int(top_k), "shared": bool(shared), "valid": bool(valid),
           "median_us": median(replay_us) if valid else None, "replay_us": list(replay_us or [])}
    if valid:
        rec.update(p10_us=percentile(replay_us, 10), p90_us=percentile(replay_us, 90))
    if reason:
        rec["reason"] = reason
    rec.update(extra)
    return rec


def _point(r) -> tuple:
    return (r["hidden"], r["top_k"], r["shared"], r["profile"], r["tokens"])


def summary_rows(records: list, copy_gbps: float, elem_bytes: int = 2) -> list:
    """One row per point (shape, profile, tokens), in the order measured: each system's time (its
    fastest valid variant; null when it has none, `null_reasons` says why), the ratios baseline /
    ours (medians of per-round ratios), the fastest baseline and ours' speed-up over it, the
    roofline and ours' fraction of it, the compile mode that won, the program ours ran."""
    order, points = {}, {}
    for r in records:
        points.setdefault(_point(r), []).append(r)
        order.setdefault(_point(r)[:3], len(order))
    profile_order = {name: i for i, name in enumerate(PROFILES)}
    rows = []
    for key in sorted(points, key=lambda k: (order[k[:3]], profile_order[k[3]], k[4])):
        recs = points[key]
        hidden, top_k, shared, profile, tokens = key

        def best(system):
            ok = [r for r in recs if r["system"] == system and r["valid"]]
            return min(ok, key=lambda r: r["median_us"]) if ok else None
        chosen = {s: best(s) for s in SYSTEMS}
        ours = chosen["ours"]
        ratios = {s: pair_ratio(chosen[s]["replay_us"], ours["replay_us"]) if ours and chosen[s] else None
                  for s in BASELINES}
        fastest = min((chosen[s] for s in BASELINES if chosen[s]), key=lambda r: r["median_us"], default=None)
        hbm = hbm_bytes_ws1(tokens, hidden, top_k, shared, profile, elem_bytes)["total"]
        roof = roofline_us(hbm, copy_gbps)
        nulls = {}
        for s in SYSTEMS:
            if chosen[s] is None:
                why = [(f"{r['variant']}: " if r.get("variant") else "") + r.get("reason", "invalid")
                       for r in recs if r["system"] == s]
                nulls[s] = "; ".join(why) if why else "not measured"
        rows.append({
            "hidden": hidden, "top_k": top_k, "shared": shared, "profile": profile, "tokens": tokens,
            "us": {s: chosen[s] and chosen[s]["median_us"] for s in SYSTEMS},
            "ratios": ratios,
            "best_baseline": fastest and fastest["system"],
            "speedup_vs_best_baseline": ratios[fastest["system"]] if fastest and ours else None,
            "hbm_bytes": hbm, "roofline_us": roof,
            "roofline_fraction": roof / ours["median_us"] if ours else None,
            "compile_mode": chosen["torch_compile"] and chosen["torch_compile"]["variant"],
            "flashinfer_finalize": chosen["flashinfer"] and chosen["flashinfer"]["variant"],
            "program": ours and ours.get("program"),
            "programs": {r["variant"]: r["median_us"] for r in recs if r["system"] == "program" and r["valid"]},
            "null_reasons": nulls,
        })
    return rows


def _verdict(*passes) -> Optional[bool]:
    """False if any check failed, True if some passed and none failed, None if none could be checked."""
    known = [p for p in passes if p is not None]
    return None if not known else all(known)


def check_targets(rows: list, empty_kernel_us: Optional[float]) -> list:
    """The targets per shape and profile: bandwidth (ours' roofline fraction from
    BANDWIDTH_FROM_TOKENS tokens), never slower than any baseline, the geometric mean over T of the
    speed-up over the fastest baseline, and ours at 1 token against the empty kernel. A check with
    nothing to check is None; a point where ours has no valid time fails `never_slower`."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["hidden"], r["top_k"], r["shared"], r["profile"]), []).append(r)
    out = []
    for (hidden, top_k, shared, profile), rs in groups.items():
        big = [r for r in rs if r["tokens"] >= BANDWIDTH_FROM_TOKENS and r["roofline_fraction"] is not None]
        worst = min(big, key=lambda r: r["roofline_fraction"], default=None)
        need = BANDWIDTH_TARGET[profile]
        bandwidth = {"from_tokens": BANDWIDTH_FROM_TOKENS, "min_fraction": need,
                     "worst_fraction": worst and worst["roofline_fraction"], "worst_tokens": worst and worst["tokens"],
                     "pass": None if worst is None else worst["roofline_fraction"] >= need}
        slower = [{"tokens": r["tokens"], "baseline": s, "ratio": v} for r in rs for s, v in r["ratios"].items()
                  if v is not None and v < 1.0]
        missing = [r["tokens"] for r in rs if r["us"]["ours"] is None and any(r["us"][s] for s in BASELINES)]
        compared = any(v is not None for r in rs for v in r["ratios"].values())
        never_slower = {"slower": slower, "ours_missing": missing,
                        "pass": False if slower or missing else (True if compared else None)}
        speedups = [r["speedup_vs_best_baseline"] for r in rs if r["speedup_vs_best_baseline"] is not None]
        gmean = math.exp(sum(math.log(v) for v in speedups) / len(speedups)) if speedups else None
        geomean = {"value": gmean, "min": SPEEDUP_GEOMEAN_TARGET, "points": len(speedups),
                   "pass": None if gmean is None else gmean >= SPEEDUP_GEOMEAN_TARGET}
        one = next((r for r in rs if r["tokens"] == 1 and r["us"]["ours"] is not None), None)
        limit = ONE_TOKEN_EMPTY_KERNELS * empty_kernel_us if empty_kernel_us else None
        one_token = {"ours_us": one and one["us"]["ours"], "limit_us": limit,
                     "pass": None if one is None or limit is None else one["us"]["ours"] <= limit}
        out.append({"hidden": hidden, "top_k": top_k, "shared": shared, "profile": profile,
                    "bandwidth": bandwidth, "never_slower": never_slower, "geomean_speedup": geomean,
                    "one_token": one_token,
                    "pass": _verdict(bandwidth["pass"], never_slower["pass"], geomean["pass"], one_token["pass"])})
    return out


def table_shape(rows: list) -> Optional[tuple]:
    """(hidden, top_k, shared) the table and the plot show: the target shape if measured, else the first."""
    shapes = [(r["hidden"], r["top_k"], r["shared"]) for r in rows]
    target = (TARGET_SHAPE.hidden, TARGET_SHAPE.top_k, TARGET_SHAPE.shared)
    return target if target in shapes else (shapes[0] if shapes else None)


def _us(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _yes(v) -> str:
    return {True: "yes", False: "**no**", None: "-"}[v]


def format_markdown(summary: dict) -> str:
    """The short table: per profile at the target shape, T, ours and each baseline (microseconds),
    ours' speed-up over the fastest baseline and its fraction of the roofline; then the targets."""
    rows = summary["rows"]
    lines = [f"World size 1 on {summary['gpu']}, {summary['dtype']}, commit {summary['commit'][:12]}, "
             f"{summary['date']}: copy {summary['copy_gbps']:.0f} GB/s (read + write), empty kernel "
             f"{_us(summary['empty_kernel_us'])} us, ours at 1 token {_us(summary['ours_1_token_us']['no_pdl'])} us "
             f"({_us(summary['ours_1_token_us']['pdl'])} us with PDL).", ""]
    shape = table_shape(rows)
    if shape is not None:
        lines += [f"Microseconds per call, H {shape[0]}, top_k {shape[1]}{' + shared expert' if shape[2] else ''}; "
                  "speed-up = the fastest baseline's time / ours (median of per-round ratios); torch.compile "
                  "d / s = dynamic shapes / compiled per T; flashinfer: compiled finalize + FlashInfer's norm "
                  "kernel, `-` where it has none (see summary.json `null_reasons`).", ""]
    for profile in PROFILES:
        mine = [r for r in rows if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile]
        if not mine:
            continue
        lines += [f"**{profile}**", "", "| T | ours | torch eager | torch.compile | flashinfer | speed-up | roofline |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in mine:
            us = r["us"]
            mode = f" ({r['compile_mode'][0]})" if r["compile_mode"] else ""
            speedup = "-" if r["speedup_vs_best_baseline"] is None else f"{r['speedup_vs_best_baseline']:.2f}x"
            frac = "-" if r["roofline_fraction"] is None else f"{100 * r['roofline_fraction']:.0f}%"
            lines.append(f"| {r['tokens']} | {_us(us['ours'])} | {_us(us['torch_eager'])} | "
                         f"{_us(us['torch_compile'])}{mode} | {_us(us['flashinfer'])} | {speedup} | {frac} |")
        lines.append("")
    lines += ["Targets: bandwidth = ours' roofline fraction from 2,048 tokens (>= 88%, NVFP4 >= 85%); never slower "
              "than any baseline; geometric mean over T of the speed-up over the fastest baseline >= 2x; 1 token <= "
              "2x the empty kernel.", "",
              "| shape | profile | bandwidth (worst) | never slower | geomean speed-up | 1 token | all |",
              "|---|---|---|---|---|---|---|"]
    for t in summary["targets"]:
        b, n, g, o = t["bandwidth"], t["never_slower"], t["geomean_speedup"], t["one_token"]
        worst = "-" if b["worst_fraction"] is None else f"{100 * b['worst_fraction']:.0f}% at {b['worst_tokens']}"
        slower = ", ".join(f"{s['baseline']} at {s['tokens']}" for s in n["slower"][:3]) + \
            ("" if len(n["slower"]) <= 3 else ", ...")
        nsl = _yes(n["pass"]) + (f" ({slower})" if slower else "") + \
            (f" (ours missing at {n['ours_missing']})" if n["ours_missing"] else "")
        gm = "-" if g["value"] is None else f"{g['value']:.2f}x"
        one = "-" if o["ours_us"] is None else f"{_us(o['ours_us'])} / {_us(o['limit_us'])} us"
        lines.append(f"| {t['hidden']}/{t['top_k']}{'s' if t['shared'] else ''} | {t['profile']} | {_yes(b['pass'])} "
                     f"({worst}) | {nsl} | {_yes(g['pass'])} ({gm}) | {_yes(o['pass'])} ({one}) | {_yes(t['pass'])} |")
    if summary.get("skipped"):
        lines += ["", f"{len(summary['skipped'])} points skipped (summary.json `skipped`)."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: pathlib.Path) -> None:
    """Latency against tokens, log-log, one line per system, one panel per profile, at table_shape;
    the roofline dotted and the empty kernel dash-dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = summary["rows"]
    shape = table_shape(rows)
    profiles = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
    if shape is None or not profiles:
        return
    fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 4.4), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        mine = [r for r in rows if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile]
        for system in SYSTEMS:
            pts = [(r["tokens"], r["us"][system]) for r in mine if r["us"][system] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, linewidth=2 if system == "ours" else 1.2, label=system)
        ax.plot([r["tokens"] for r in mine], [r["roofline_us"] for r in mine], "k:", label="HBM roofline")
        if summary.get("empty_kernel_us"):
            ax.axhline(summary["empty_kernel_us"], color="grey", linestyle="-.", linewidth=1, label="empty kernel")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(profile, fontsize=10)
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"world size 1, H {shape[0]} top_k {shape[1]}{' + shared' if shape[2] else ''}, {summary['gpu']}, "
                 f"{summary['dtype']}, {summary['commit'][:12]}, {summary['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(header: dict, records: list, skipped: list, complete: bool) -> dict:
    """summary.json: the run's header (gpu, commit, copy_gbps, empty_kernel_us, ours_1_token_us,
    versions, date, config ...), the rows, the targets, what was skipped."""
    rows = summary_rows(records, header["copy_gbps"], DTYPE_BYTES[header["dtype"]])
    return dict(header, rows=rows, targets=check_targets(rows, header.get("empty_kernel_us")),
                skipped=skipped, complete=complete)


# =================================================================================================
# GPU side
# =================================================================================================

def contract_ws1(inputs, dtype) -> tuple:
    """(residual_out, norm_out) of the world-size-1 contract as float32 tensors: residual_out = the
    float64 partial + residual_in rounded to dtype once, norm_out the float64 RMSNorm of it."""
    from moe_ar_tools import reference as ref
    partial = ref.finalize_partial(inputs.allreduce_in, inputs.idx, inputs.scale, ROUTED_SCALING_FACTOR,
                                   inputs.shared)
    residual = ref.round_to_dtype(partial + inputs.residual.double(), dtype)
    del partial
    norm = ref.rmsnorm_f64(residual, inputs.norm_weight, EPS, 0)
    return residual.float(), norm.float()


def dequantize(outs: dict, profile: str, fp8_scale_value: float, gs_value: float):
    """float32 [T, H] of a system's quantized output (its scales as laid out)."""
    from moe_ar_tools import reference as ref
    p = PROFILES[profile]
    q = outs["quant_out"]
    if p.quant == "nvfp4":
        T, H = q.shape[0], q.shape[1] * 2
        return ref.nvfp4_dequant(q, outs["scale_out"], gs_value, T, H)
    if p.quant == "fp8_tensor":
        return q.float() * fp8_scale_value
    T = q.shape[0]
    scales = outs["scale_out"] if p.scale_layout == "row" else outs["scale_out"][:, :T].t()
    return q.float() * scales.repeat_interleave(128, dim=1)


def worst(a: float, b: float) -> float:
    """The larger error, NaN (an output left unwritten, still poisoned) above any number: Python's
    max(0.0, nan) is 0.0."""
    return b if math.isnan(b) or b > a else a


def alloc_outputs(tokens: int, hidden: int, dtype, profile: str, device) -> dict:
    """The outputs ours writes (dispatch's out arguments) for one input set."""
    import torch
    from dispatch.op import fp8_scale_shape, scale_out_bytes
    p = PROFILES[profile]
    outs = {"norm_out": torch.empty(tokens, hidden, dtype=dtype, device=device),
            "residual_out": torch.empty(tokens, hidden, dtype=dtype, device=device)}
    if p.quant == "nvfp4":
        outs["quant_out"] = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=device)
        outs["scale_out"] = torch.empty(scale_out_bytes(tokens, hidden), dtype=torch.uint8, device=device)
    elif p.quant is not None:
        outs["quant_out"] = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device)
    if p.quant == "fp8_group128":
        outs["scale_out"] = torch.empty(fp8_scale_shape(tokens, hidden, p.scale_layout), dtype=torch.float32,
                                        device=device)
    return outs


_EMPTY_SOURCE = 'extern "C" __global__ void moe_ar_empty() {}\n'


class EmptyKernel:
    """An empty kernel (one block of 32 threads) compiled with the programs' NVRTC, launched on
    torch's current stream: the floor any launch pays."""

    def __init__(self, device_index: int):
        import cupy
        from cupy.cuda import function
        from dispatch import registry
        capability = cupy.cuda.Device(device_index).compute_capability
        target = registry.TARGET_FOR_CAPABILITY[(int(capability[:-1]), int(capability[-1]))]
        cubin, _ = registry.compile_cubin(_EMPTY_SOURCE, "bench_empty_kernel", target)
        with cupy.cuda.Device(device_index):
            self.module = function.Module()
            self.module.load(cubin)
            self.function = self.module.get_function("moe_ar_empty")

    def __call__(self) -> None:
        import torch
        from cuda.bindings import driver as cu
        err, = cu.cuLaunchKernel(cu.CUfunction(int(self.function.ptr)), 1, 1, 1, 32, 1, 1, 0,
                                 cu.CUstream(torch.cuda.current_stream().cuda_stream), None, 0)
        if int(err) != 0:
            raise RuntimeError(f"empty kernel launch failed: {err}")


@dataclass
class System:
    """One competitor at one point. call(j) makes captured call j (input set j % sets) and returns its
    outputs when it allocates them (the chains), None when it writes preallocated ones (ours);
    `outputs` lists (index, outputs) to check, the index a call's or an input set's (the check
    takes it modulo the sets); prepare() poisons them, and restores what a system updates in place,
    before a checked replay."""
    system: str
    variant: Optional[str]
    call: Callable[[int], Optional[dict]]
    outputs: list = field(default_factory=list)
    restore: Optional[Callable[[], None]] = None
    program: Optional[str] = None
    detail: dict = field(default_factory=dict)
    graph: object = None
    compile_s: Optional[float] = None

    @property
    def label(self) -> str:
        return self.system + (f"/{self.variant}" if self.variant else "")

    def prepare(self) -> None:
        from moe_ar_tools import reference as ref
        if self.restore is not None:
            self.restore()
        for _, outs in self.outputs:
            ref.repoison({k: v for k, v in outs.items() if not (self.restore and k == "residual_out")})


def _error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _versions() -> dict:
    import torch
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for name in ("cupy", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


class Runner:
    """The run on this process's current GPU (another `device`, with a `capability` to assume, only for
    the CPU test that stubs CUDA graphs, events and the op)."""

    def __init__(self, cfg: Config, device=None, capability: tuple = (9, 0)):
        import torch
        self.cfg = cfg
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        self.capability, self.l2_bytes = capability, bench.FALLBACK_L2_BYTES
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.capability = (props.major, props.minor)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or bench.FALLBACK_L2_BYTES)
        self.records, self.skipped = [], []
        self.workspaces, self.compiled = {}, {}
        self.failed = {}  # (system, compile mode, profile) -> why it could not run: not compiled again
        self.flashinfer, self.flashinfer_info = None, {}
        self.longest_point_s = 0.0
        self.out = pathlib.Path(cfg.out) if cfg.out else pathlib.Path("bench_results") / "world_size_1" / \
            f"run-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    # -- setup --
    def workspace(self, hidden: int):
        import dispatch
        if hidden not in self.workspaces:
            self.workspaces[hidden] = dispatch.LocalWorkspace(max_tokens=max(self.cfg.tokens), hidden=hidden,
                                                              dtype=self.dtype)
        return self.workspaces[hidden]

    def programs_for(self, profile: str) -> list:
        """Every world-size-1 program of this dtype for the profile."""
        import dispatch
        from dispatch.op import profile_for_quant
        want = (1, self.cfg.dtype, profile_for_quant(PROFILES[profile].quant))
        infos = {n: dispatch.program_info(n) for n in dispatch.programs()}
        return [n for n, i in infos.items() if (i["world_size"], i["dtype"], i["profile"]) == want]

    def compiled_fns(self, mode: str):
        """torch_chain.compiled(mode), made once; a failure to set it up is kept as its reason."""
        from moe_ar_tools.baselines import torch_chain
        if mode not in self.compiled:
            try:
                self.compiled[mode] = torch_chain.compiled(mode)
            except Exception as e:  # noqa: BLE001 - recorded, the compiled systems null
                self.compiled[mode] = _error(e)
        return self.compiled[mode]

    def load_flashinfer(self) -> None:
        from moe_ar_tools.baselines import flashinfer_norm
        where = pathlib.Path(self.cfg.flashinfer_dir) if self.cfg.flashinfer_dir else flashinfer_norm.DEFAULT_DIR
        t0 = time.perf_counter()
        try:
            info = flashinfer_norm.read_info(where)
            self.flashinfer = flashinfer_norm.load(where, self.capability)
            self.flashinfer_info = {"available": True, "version": info.get("version"), "library": str(self.flashinfer.path),
                                    "kernels": "CUDA (include/flashinfer/norm.cuh)", "pdl": self.capability >= (9, 0),
                                    "load_s": time.perf_counter() - t0}
            self.log(f"FlashInfer {info.get('version')} norm kernels: {self.flashinfer.path} "
                     f"({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 - the flashinfer system is then null with this reason
            self.flashinfer_info = {"available": False, "reason": _error(e)}
            self.log(f"FlashInfer unavailable: {self.flashinfer_info['reason']}")

    # -- inputs --
    def inputs(self, shape: Shape, T: int) -> dict:
        import torch
        from moe_ar_tools import reference as ref
        bytes_per_set = (T * shape.top_k + T * (2 if shape.shared else 1)) * shape.hidden * DTYPE_BYTES[self.cfg.dtype]
        n = bench.input_sets_for(bytes_per_set, self.l2_bytes, self.cfg.calls)
        sets = bench.make_input_sets(shape, T, n, self.dtype, 0, self.cfg.seed, self.device)
        refs = [contract_ws1(x, self.dtype) for x in sets]
        amax = max(float(norm.abs().max()) for _, norm in refs)
        gs_value, fp8_value = ref.f32(ref.E4M3_MAX * 6.0 / amax), ref.f32(amax / ref.E4M3_MAX)
        return {"sets": sets, "refs": refs, "gs_value": gs_value, "fp8_value": fp8_value,
                "gs": torch.tensor([gs_value], dtype=torch.float32, device=self.device),
                "fp8": torch.tensor([fp8_value], dtype=torch.float32, device=self.device)}

    # -- systems --
    def ours(self, shape: Shape, T: int, profile: str, data: dict, program=None, pdl=False, variant=None) -> System:
        import dispatch
        p, sets = PROFILES[profile], data["sets"]
        ws = self.workspace(shape.hidden)
        outs = [alloc_outputs(T, shape.hidden, self.dtype, profile, self.device) for _ in sets]
        extra = {}
        if p.quant == "nvfp4":
            extra["global_scale"] = data["gs"]
        if p.quant == "fp8_tensor":
            extra["fp8_scale"] = data["fp8"]
        if p.quant == "fp8_group128":
            extra["fp8_scale_layout"] = p.scale_layout

        def call(j):
            i = j % len(sets)
            x = sets[i]
            dispatch.moe_finalize_allreduce(
                ws, allreduce_in=x.allreduce_in, expanded_idx_to_permuted_idx=x.idx, residual_in=x.residual,
                norm_weight=x.norm_weight, expert_scale_factor=x.scale, routed_scaling_factor=ROUTED_SCALING_FACTOR,
                shared_expert_output=x.shared, eps=EPS, quant=p.quant, launch_with_pdl=pdl, program=program,
                **extra, **outs[i])
        if program is None:
            try:
                chosen = dispatch.select_program(ws, T, p.quant, shape.shared)
            except Exception as e:  # noqa: BLE001 - metadata: the run goes on without the name
                chosen = f"unknown ({_error(e)})"
        else:
            chosen = program
        return System("ours" if program is None else "program", variant, call, list(enumerate(outs)), program=chosen,
                      detail={"pdl": pdl})

    def chain_system(self, system: str, fn, variant, T: int, profile: str, data: dict) -> System:
        p, sets = PROFILES[profile], data["sets"]

        def call(j):
            x = sets[j % len(sets)]
            return fn(x.allreduce_in, x.idx, x.scale, x.shared, x.residual, x.norm_weight, EPS, p.quant,
                      p.scale_layout == "column", data["gs"], data["fp8"])
        return System(system, variant, call)

    def flashinfer_system(self, finalize, variant, shape: Shape, T: int, profile: str, data: dict) -> System:
        """The compiled finalize, then FlashInfer's norm kernel in place on one residual buffer per
        captured call (restored from residual_in before each checked replay)."""
        import torch
        p, sets, fi, calls = PROFILES[profile], data["sets"], self.flashinfer, self.cfg.calls
        residuals = [torch.empty(T, shape.hidden, dtype=self.dtype, device=self.device) for _ in range(calls)]
        pdl = self.capability >= (9, 0)  # FlashInfer's default (device_support_pdl)

        def restore():
            for j, buf in enumerate(residuals):
                buf.copy_(sets[j % len(sets)].residual)

        def call(j):
            x = sets[j % len(sets)]
            partial = finalize(x.allreduce_in, x.idx, x.scale, x.shared)
            if p.quant is None:
                fi.fused_add_rmsnorm(partial, residuals[j], x.norm_weight, EPS, pdl)
                return {"residual_out": residuals[j], "norm_out": partial}
            quant_out = torch.empty(T, shape.hidden, dtype=torch.float8_e4m3fn, device=self.device)
            fi.fused_add_rmsnorm_quant(quant_out, partial, residuals[j], x.norm_weight, data["fp8_value"], data["fp8"],
                                       EPS, pdl)
            return {"residual_out": residuals[j], "quant_out": quant_out}
        restore()
        return System("flashinfer", variant, call, restore=restore,
                      detail={"pdl": pdl, "writes_norm_out": p.quant is None})

    def build_systems(self, shape: Shape, T: int, profile: str, data: dict) -> tuple:
        """(systems to run, records of systems that cannot run here)."""
        from moe_ar_tools.baselines import flashinfer_norm, torch_chain
        cfg, p = self.cfg, PROFILES[profile]
        where = dict(profile=profile, tokens=T, hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared)
        systems, nulls = [], []
        if "ours" in cfg.systems:
            systems.append(self.ours(shape, T, profile, data))
            forced = self.programs_for(profile) if cfg.programs else []
            if len(forced) > 1:
                systems += [self.ours(shape, T, profile, data, program=name, variant=name) for name in forced]
        if "torch_eager" in cfg.systems:
            systems.append(self.chain_system("torch_eager", torch_chain.chain, None, T, profile, data))
        modes = [m for m in cfg.compile_modes if m == "dynamic" or cfg.static_compile(shape)]
        for system in ("torch_compile", "flashinfer"):
            if system not in cfg.systems:
                continue
            if system == "flashinfer":
                why = self.flashinfer_info.get("reason") or flashinfer_norm.unsupported(p.quant, self.capability)
                if why:
                    nulls.append(make_record(system=system, valid=False, reason=why, unavailable=True, **where))
                    continue
            for mode in modes:
                fns = self.compiled_fns(mode)
                if isinstance(fns, str) or (system, mode, profile) in self.failed:
                    why = f"torch.compile unavailable: {fns}" if isinstance(fns, str) else \
                        self.failed[(system, mode, profile)]
                    nulls.append(make_record(system=system, variant=mode, valid=False, reason=why, **where))
                elif system == "torch_compile":
                    systems.append(self.chain_system(system, fns["chain"], mode, T, profile, data))
                else:
                    systems.append(self.flashinfer_system(fns["finalize"], mode, shape, T, profile, data))
        return systems, nulls

    # -- capture, check, time --
    def capture(self, system: System) -> Optional[str]:
        """Warm-up calls (the first compiles a compiled system: its time is kept), then one CUDA graph
        of `calls` back-to-back calls. Returns an error string, or None."""
        import torch
        try:
            for j in range(self.cfg.warmup):
                t0 = time.perf_counter()
                system.call(j % self.cfg.calls)
                if j == 0:
                    torch.cuda.synchronize(self.device)
                    system.compile_s = time.perf_counter() - t0
            torch.cuda.synchronize(self.device)
            graph, captured = torch.cuda.CUDAGraph(), []
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for j in range(self.cfg.calls):
                    captured.append(system.call(j))
            torch.cuda.synchronize(self.device)
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
            errs["residual_out"] = worst(errs["residual_out"], bench.rel_err(outs["residual_out"], res_ref))
            if "norm_out" in outs:
                errs["norm_out"] = worst(errs["norm_out"], bench.rel_err(outs["norm_out"], norm_ref))
            if p.quant is not None:
                base = outs["norm_out"].float() if "norm_out" in outs else norm_ref
                deq = dequantize(outs, profile, data["fp8_value"], data["gs_value"])
                errs["quant"] = worst(errs["quant"], bench.rel_err(deq, base))
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
        """[system][replay]: microseconds per call; rounds interleaved in shuffled orders."""
        import torch
        reps = self.cfg.reps
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                  for _ in systems]
        for r, order in enumerate(bench.replay_orders(len(systems), reps, self.cfg.seed)):
            for j in order:
                start, end = events[j][r]
                start.record()
                systems[j].graph.replay()
                end.record()
        torch.cuda.synchronize(self.device)
        return [[start.elapsed_time(end) * 1e3 / self.cfg.calls for start, end in row] for row in events]

    def measure(self, systems: list, profile: str, data: dict, where: dict) -> list:
        """Capture, check, time and check again; returns the records (every system, valid or not)."""
        records, ready = [], []
        for s in systems:
            err = self.capture(s)
            if s.compile_s is not None and s.compile_s > 1.0 and s.system in ("torch_compile", "flashinfer"):
                self.log(f"    compiled {s.label} in {s.compile_s:.1f} s")
            if err:
                records.append(make_record(system=s.system, variant=s.variant, valid=False,
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
                records.append(make_record(system=s.system, variant=s.variant, valid=False,
                                           reason="wrong result: " + "; ".join(before[id(s)]), program=s.program,
                                           **s.detail, **where))
            else:
                good.append(s)
        times = self.timed_loop(good) if good else []
        after = self.checked_replay(good, profile, data) if good else {}
        for s, replay_us in zip(good, times):
            extra = dict(s.detail, program=s.program, compile_s=s.compile_s, calls_per_graph=self.cfg.calls,
                         input_sets=len(data["sets"]), reps=self.cfg.reps)
            if after[id(s)]:
                records.append(make_record(system=s.system, variant=s.variant, valid=False,
                                           reason="wrong result after the timed replays: " + "; ".join(after[id(s)]),
                                           **extra, **where))
            else:
                records.append(make_record(system=s.system, variant=s.variant, valid=True, replay_us=replay_us,
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
        where = dict(profile="plain", tokens=1, hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared)
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
        total = len(cfg.shapes) * len(cfg.tokens) * len(cfg.profiles)
        done = 0
        for shape in cfg.shapes:
            for T in cfg.tokens:
                data = None
                for profile in cfg.profiles:
                    done += 1
                    where = dict(profile=profile, tokens=T, hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared)
                    if self.over_budget():
                        self.skipped.append(dict(where, reason=f"budget: {cfg.budget_s:.0f} s"))
                        continue
                    t0 = time.time()
                    data = data or self.inputs(shape, T)
                    systems, nulls = self.build_systems(shape, T, profile, data)
                    recs = nulls + self.measure(systems, profile, data, where)
                    self.records += recs
                    spent = time.time() - t0
                    self.longest_point_s = max(self.longest_point_s, spent)
                    best = {}
                    for r in recs:
                        if r["valid"] and (r["system"] not in best or r["median_us"] < best[r["system"]]):
                            best[r["system"]] = r["median_us"]
                    self.log(f"[{done}/{total}] {shape.label} T={T} {profile}: " +
                             ", ".join(f"{s} {_us(best.get(s))}" for s in SYSTEMS if s in cfg.systems) +
                             f" us ({spent:.1f} s, {time.time() - cfg.started:.0f} s in)")
                del data
                torch.cuda.empty_cache()
            self.write(header, final=False)  # a killed run keeps what it measured

    def write(self, header: dict, final: bool) -> dict:
        header["wall_s"] = time.time() - self.cfg.started
        summary = summarize(header, self.records, self.skipped, complete=final and not self.skipped)
        self.out.mkdir(parents=True, exist_ok=True)
        for name, obj in (("summary.json", summary), ("records.json", {"records": self.records})):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(json.dumps(bench.jsonable(obj), indent=1, allow_nan=False))
            os.replace(tmp, self.out / name)
        if final:
            (self.out / "table.md").write_text(format_markdown(summary))
            try:
                plot(summary, self.out / "latency.png")
            except Exception as e:  # noqa: BLE001 - the JSON is what matters
                self.log(f"plot failed: {_error(e)}")
        return summary

    def run(self) -> dict:
        import torch
        import dispatch
        cfg = self.cfg
        if "ours" in cfg.systems and not hasattr(dispatch, "LocalWorkspace"):
            raise click.ClickException("dispatch.LocalWorkspace is missing: this tree has no world-size-1 runtime")
        gpu = torch.cuda.get_device_name(self.device)
        header = {"gpu": gpu, "commit": git_commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "driver": _driver_version(), "versions": _versions(), "dtype": cfg.dtype, "world_size": 1,
                  "config": dict(plan(cfg), seed=cfg.seed, warmup=cfg.warmup, routed_scaling_factor=ROUTED_SCALING_FACTOR,
                                 eps=EPS, tolerance={"rel_u": TOLERANCE_U, "nvfp4_rel": NVFP4_TOLERANCE,
                                                     "fp8_rel": FP8_TOLERANCE}, l2_bytes=self.l2_bytes)}
        self.log(f"moe-ar-bench-one: {gpu}, commit {header['commit'][:12]}; writing {self.out}")
        bandwidth = bench.measure_bandwidth(1, cfg.bw_gib)
        header.update(bandwidth=bandwidth, copy_gbps=bandwidth["hbm_GBps"])
        self.log(f"  copy {bandwidth['hbm_GBps']:.0f} GB/s (device to device, read + write)")
        if "ours" in cfg.systems:
            names = sorted({n for p in cfg.profiles for n in self.programs_for(p)})
            t0 = time.perf_counter()
            dispatch.warmup(names, device_index=self.device.index)
            self.log(f"  {len(names)} world-size-1 programs ready in {time.perf_counter() - t0:.1f} s")
        if "flashinfer" in cfg.systems:
            self.load_flashinfer()
        header["flashinfer"] = self.flashinfer_info
        floor = self.floor()
        header.update(empty_kernel_us=floor["empty_kernel"], ours_1_token_us={"no_pdl": floor["no_pdl"], "pdl": floor["pdl"]},
                      floor=floor)
        self.log(f"  empty kernel {_us(floor['empty_kernel'])} us; ours at 1 token {_us(floor['no_pdl'])} us, "
                 f"{_us(floor['pdl'])} us with PDL")
        self.sweep(header)
        summary = self.write(header, final=True)
        for ws in self.workspaces.values():
            if hasattr(ws, "close"):
                ws.close()
        print(format_markdown(summary), flush=True)
        self.log(f"wrote {self.out}/summary.json, records.json, table.md, latency.png")
        return summary


# ---- command line ------------------------------------------------------------------------------

@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--shapes", default=DEFAULT_SHAPES, help="HIDDEN:TOP_K[:shared], comma separated (the first is "
                                                      "also the floor's shape)")
@click.option("--tokens", default=DEFAULT_TOKENS, help="comma separated, or a power-of-two range like 1-16384")
@click.option("--profiles", default=",".join(PROFILES), help="output profiles, comma separated")
@click.option("--systems", default=",".join(SYSTEMS), help="systems, comma separated")
@click.option("--compile-modes", default=",".join(COMPILE_MODES),
              help="torch.compile modes: dynamic (one compile for every T), static (one per T)")
@click.option("--static-compile-shapes", default="7168:8:shared",
              help="shapes compiled per T too (compiles are slow: the target shape); empty for none")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bf16")
@click.option("--reps", default=50, help="timed replays per system and point (at least 50)")
@click.option("--calls", default=10, help="back-to-back calls captured in one CUDA graph")
@click.option("--warmup", default=3, help="eager calls before capture")
@click.option("--budget-s", default=DEFAULT_BUDGET_S, help="no point starts that would end past this many "
                                                           "seconds from launch (0: no budget); the rest is skipped")
@click.option("--out", default=None, help="output folder [default: bench_results/world_size_1/run-<date>]")
@click.option("--seed", default=1234)
@click.option("--bw-gib", default=2.0, help="GiB per copy in the bandwidth measurement")
@click.option("--flashinfer-dir", default=None, help="FlashInfer's norm kernels as fetch_flashinfer.sh prepares "
                                                     "them [default: .baselines/flashinfer]")
@click.option("--programs/--no-programs", default=True,
              help="also force every world-size-1 program where a cell has more than one")
@click.option("--dry-run", is_flag=True, help="print what would be measured and compiled, then stop (no GPU)")
def main(dry_run, **options):
    """Benchmark the world-size-1 op against the eager and compiled torch chains and FlashInfer's norm
    kernels on one GPU."""
    started = time.time()
    try:
        cfg = make_config(started=started, **options)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if cfg.reps < 50:
        click.echo(f"note: --reps {cfg.reps} is below the 50 of docs/measurement.md", err=True)
    if dry_run:
        click.echo(json.dumps(plan(cfg), indent=1))
        return
    import torch
    if not torch.cuda.is_available():
        raise click.ClickException("no CUDA GPU: moe-ar-bench-one runs on one GPU (--dry-run shows the plan)")
    Runner(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
