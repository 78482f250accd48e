"""Benchmark of the fused MoE finalize + all-reduce + residual + RMSNorm (+ NVFP4) op against
unfused baselines, following docs/measurement.md.

    moe-ar-bench --out bench_results/run.json          (or python -m moe_ar_tools.bench)

on a machine with at least --world GPUs (default 2). It writes the JSON (--out, default
bench_results/<machine>-<date>.json; rewritten after every shape, so a killed run keeps what it
measured), a PNG plot and a .summary.txt table beside it, and prints the table. The default
sweep (docs/measurement.md's four shapes, 1..16384 tokens, profiles 110 and 111) is sized for about 8
minutes on 2x H200; --time-budget-s stops it early (the JSON then says "truncated": true).

What it measures, per shape (hidden, top_k, shared expert), token count T and output profile
("110": bf16/fp16 outputs; "111": + NVFP4), on W GPUs with one process each:

  nccl+torch   the unfused step: finalize with torch ops (gather the expert rows, weight them
               by the router scales times routed_scaling_factor, sum over top_k, add the shared
               expert), NCCL all_reduce, residual add and RMSNorm with torch ops. Profile 110 only
               (torch has no NVFP4 quantizer to compare with).
  symm+torch   the same torch ops around torch's symmetric-memory all-reduce, one-shot and
               two-shot (peer loads/stores, never NVLink multicast), where the installed torch
               offers it. Profile 110 only. Records carry `variant`.
  nccl+compiled, symm+compiled
               the same two steps with the finalize and the residual + RMSNorm epilogue each
               wrapped in torch.compile (inductor, fullgraph, static shapes; compiled per shape
               before capture, the compiled code captured in the graph around the all-reduce):
               the best unfused step a user gets without our kernel. A compile failure skips
               them for the rest of the run, with the reason recorded.
  auto         dispatch.moe_finalize_allreduce with the dispatcher choosing the program.
  auto+quant   FP8 profiles only: the unfused alternative to a fused FP8 output, i.e. auto with
               plain output (profile 110) followed by a separate FP8 quantization kernel
               (one launch, one read of norm_out, the same rule, bytes checked like ours).
  <program>    every generated program of this dtype / world size / profile, forced by name.

Timing protocol: every system's step is captured in one CUDA graph of `calls` back-to-back
calls (static inputs, rotating among a few input sets so that L2 cannot hold them all at large
T); the graphs are replayed interleaved, each system once a round, in an order shuffled per
round (A C B, B A C, ...: no system always follows the same one or comes first). Each replay is
timed with CUDA events on every rank; a replay's time is the maximum over ranks (the slowest
rank is the step time), divided by `calls`. A record's median_us is the median over `reps`
replays; ratios are medians of per-replay ratios against the baseline replayed in the same
round, so drift cancels. ratio_vs_best_baseline is against the unfused baseline (nccl/symm, torch
or compiled, any variant) with the smallest median at that point in the same run.

Correctness: outputs are checked against a float64 reference (each rank's partial rounded to
the dtype once, summed across ranks in float64, residual rounded once, RMSNorm in float64)
with a norm-relative tolerance, before and after the timed replays, and compared bit for bit
across ranks; NVFP4 outputs are dequantized and compared with the kernel's own norm_out. A
failed check voids the record (`"valid": false` with the reason).

Roofline: the bytes the op must move through HBM and over NVLink (per rank, by exchange
regime), divided by the HBM and peer-copy bandwidths measured in the same run; the floor is
the larger of the two times.

The pure-Python parts (shape parsing, byte counts, statistics, record schema, summary) are at
the top and are tested on CPU by tests/test_bench_cpu.py; everything that needs a GPU is
imported lazily below them.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import click

from moe_ar_tools.provenance import REPO_ROOT, git_commit

# NVLink multicast (NVLS) must never be used on the benchmark machine; set before any CUDA
# library is initialized, in the parent and in every worker.
REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

DEFAULT_SHAPES = "7168:8:shared,7168:8,7168:4:shared,4096:8"
DEFAULT_TOKENS = ",".join(str(2 ** i) for i in range(15))  # 1 .. 16384
DEFAULT_SYSTEMS = "nccl+torch,symm+torch,nccl+compiled,symm+compiled,auto,auto+quant,programs"
# the unfused finalize + all-reduce + epilogue steps; "best baseline" is the fastest of these
UNFUSED_BASELINES = ("nccl+torch", "symm+torch", "nccl+compiled", "symm+compiled")
BASELINES = UNFUSED_BASELINES + ("auto+quant",)
SYSTEM_CHOICES = ("auto", "nccl+torch", "symm+torch", "nccl+compiled", "symm+compiled", "auto+quant", "programs")
COMPILED_SYSTEMS = ("nccl+compiled", "symm+compiled")
# output profile -> quant argument
PROFILES = {"110": None, "111": "nvfp4", "fp8_group128": "fp8_group128", "fp8_tensor": "fp8_tensor"}
FP8_PROFILES = ("fp8_group128", "fp8_tensor")
DTYPE_BYTES = {"bf16": 2, "fp16": 2}

# Norm-relative tolerance of residual_out and norm_out against the float64 reference, in units
# of the dtype's unit roundoff u. The fused programs round once (error about u/3); the torch
# baselines round after every op (about u); a wrong result is off by order 1.
TOLERANCE_U = 8
# Norm-relative error of NVFP4 dequant(quant_out, scale_out) against the kernel's own norm_out.
# E2M1 with a per-16 scale gives about 0.1 on Gaussian data; garbage gives about 1.
NVFP4_TOLERANCE = 0.25
# The same for FP8 E4M3 (3 mantissa bits: about 0.02 on Gaussian data).
FP8_TOLERANCE = 0.08

ROUTED_SCALING_FACTOR = 2.5  # DeepSeek-V3's
EPS = 1e-6
FALLBACK_L2_BYTES = 60 * 2 ** 20


# ---- configuration parsing ---------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One row of the shape table (docs/measurement.md)."""
    hidden: int
    top_k: int
    shared: bool

    @property
    def label(self) -> str:
        return f"H{self.hidden} K{self.top_k} {'shared' if self.shared else 'no shared'}"


def parse_shapes(text: str) -> list[Shape]:
    """"7168:8:shared,4096:8" -> [Shape(7168, 8, True), Shape(4096, 8, False)]."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("shared", "noshared")):
            raise ValueError(f"shape {item!r}: expected HIDDEN:TOP_K or HIDDEN:TOP_K:shared")
        hidden, top_k = int(parts[0]), int(parts[1])
        if hidden <= 0 or hidden % 16 or not 1 <= top_k <= 16:
            raise ValueError(f"shape {item!r}: hidden must be a positive multiple of 16, top_k 1..16")
        shapes.append(Shape(hidden, top_k, len(parts) == 3 and parts[2] == "shared"))
    if not shapes:
        raise ValueError("shapes: none given")
    return shapes


def parse_tokens(text: str) -> list[int]:
    """"1,2,4" or a power-of-two range "1-16384" -> sorted distinct token counts."""
    out = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "-" in item:
            lo, hi = (int(x) for x in item.split("-"))
            tokens = lo
            while tokens <= hi:
                out.add(tokens)
                tokens *= 2
        else:
            out.add(int(item))
    if not out or min(out) < 1:
        raise ValueError(f"tokens {text!r}: need positive integers")
    return sorted(out)


def parse_list(text: str, allowed=None, what="value") -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if allowed is not None:
        for s in items:
            if s not in allowed:
                raise ValueError(f"{what} {s!r}: expected one of {', '.join(allowed)}")
    return items


# ---- roofline ----------------------------------------------------------------------------------

def hbm_bytes(tokens: int, hidden: int, top_k: int, shared: bool, profile: str, elem_bytes: int = 2,
              dropped_routes: int = 0, scale_bytes: int = 4) -> dict:
    """Bytes one rank's op must move through HBM, by term.

    expert_rows  (T*K - dropped) rows of H elements read (dropped routes read nothing)
    routing      expanded_idx_to_permuted_idx (int32) and expert_scale_factor, T*K entries each
    shared       the shared expert's [T, H] partial, read once (if present)
    residual     residual_in [T, H], read once
    norm_weight  gamma [H]
    outputs      residual_out and norm_out [T, H], written once each
    nvfp4        quant_out T*H/2 bytes + the swizzled scale bytes (profile 111 only)
    fp8          quant_out T*H bytes (+ T*H/128 float32 scales for fp8_group128)
    """
    from dispatch.op import scale_out_bytes  # the runtime's rule (importing dispatch loads torch)
    T, H, K, E = tokens, hidden, top_k, elem_bytes
    terms = {
        "expert_rows": (T * K - dropped_routes) * H * E,
        "routing": T * K * (4 + scale_bytes),
        "shared": T * H * E if shared else 0,
        "residual": T * H * E,
        "norm_weight": H * E,
        "outputs": 2 * T * H * E,
        "nvfp4": (T * H // 2 + scale_out_bytes(T, H)) if profile == "111" else 0,
        "fp8": T * H + (T * (H // 128) * 4 if profile == "fp8_group128" else 0) if profile in FP8_PROFILES else 0,
    }
    terms["total"] = sum(terms.values())
    return terms


def nvlink_bytes(tokens: int, hidden: int, world_size: int, regime: str, elem_bytes: int = 2) -> float:
    """Bytes one rank sends over NVLink: one-shot sends its whole partial to every peer,
    (W-1)*T*H*e; two-shot (and NCCL's ring) sends (W-1)/W of it in the reduce-scatter and as
    much again in the all-gather, 2*(W-1)/W*T*H*e."""
    payload = tokens * hidden * elem_bytes
    if regime == "one_shot":
        return float((world_size - 1) * payload)
    if regime == "two_shot":
        return 2.0 * (world_size - 1) / world_size * payload
    raise ValueError(f"regime {regime!r}: expected one_shot or two_shot")


def roofline(hbm: float, nvlink: float, hbm_GBps: float, nvlink_GBps: float) -> dict:
    """Times (microseconds) to move the bytes at the measured bandwidths; the floor is the larger."""
    hbm_us = hbm / (hbm_GBps * 1e9) * 1e6
    nvlink_us = nvlink / (nvlink_GBps * 1e9) * 1e6 if nvlink else 0.0
    return {"hbm_us": hbm_us, "nvlink_us": nvlink_us, "roofline_us": max(hbm_us, nvlink_us),
            "bound": "hbm" if hbm_us >= nvlink_us else "nvlink"}


def regime_of_family(family: str) -> str:
    return "one_shot" if family == "oneshot" else "two_shot"


# ---- statistics --------------------------------------------------------------------------------

def median(xs) -> float:
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("median of nothing")
    return float(statistics.median(xs))


def percentile(xs, q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        raise ValueError("percentile of nothing")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pair_ratio(times, baseline_times) -> float:
    """Median over replays i of times[i] / baseline_times[i] (below 1: faster than the baseline).

    The two series come from the same interleaved loop, replay i of both in the same round,
    so slow drift of the machine cancels in each ratio."""
    if len(times) != len(baseline_times) or not times:
        raise ValueError(f"pair_ratio: {len(times)} and {len(baseline_times)} replays")
    return median(a / b for a, b in zip(times, baseline_times))


def replay_orders(n: int, rounds: int, seed: int) -> list[list[int]]:
    """The order of the n systems in each of `rounds` rounds: every round replays each system
    once (interleaved, docs/measurement.md), in an order shuffled per round. A fixed order puts one system
    always after the same neighbour (the baselines, say) and at the same place in the round:
    auto, replayed first after the baselines, measured up to 7% slower than the very program it
    ran at 16 NVFP4 tokens and 2.5-3.5% faster at 2,048-16,384 tokens. The orders depend only on
    the arguments, so every rank replays the same sequence (collectives must match)."""
    if n < 1 or rounds < 1:
        raise ValueError(f"replay_orders: n={n} systems and rounds={rounds} must be positive")
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def slowest_rank(per_rank_times) -> list[float]:
    """[rank][replay] -> [replay]: the maximum over ranks (the step ends when the slowest does)."""
    return [max(col) for col in zip(*per_rank_times)]


# ---- records -----------------------------------------------------------------------------------

RECORD_KEYS = ("system", "world_size", "emulated", "dtype", "hidden", "top_k", "shared", "profile",
               "tokens", "median_us", "roofline_us", "valid")
RATIO_KEYS = ("ratio_vs_nccl_torch", "ratio_vs_symm_torch", "ratio_vs_nccl_compiled", "ratio_vs_symm_compiled",
              "ratio_vs_best_baseline", "ratio_vs_best_program")


def make_record(*, system: str, world_size: int, dtype: str, hidden: int, top_k: int, shared: bool,
                profile: str, tokens: int, median_us: Optional[float], roofline_us: float, valid: bool,
                emulated: bool = False, **extra) -> dict:
    """One measured point, required keys first (RECORD_KEYS), then the extras given.

    Ratios (RATIO_KEYS) are time ratios, system / baseline, medians of per-replay pairs."""
    if not system or not isinstance(system, str):
        raise ValueError("record: system must be a non-empty string")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"record: dtype {dtype!r}")
    if profile not in PROFILES:
        raise ValueError(f"record: profile {profile!r}")
    for name, v in (("world_size", world_size), ("hidden", hidden), ("top_k", top_k), ("tokens", tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"record: {name} must be a positive int, got {v!r}")
    if median_us is not None and not (isinstance(median_us, (int, float)) and median_us > 0):
        raise ValueError(f"record: median_us must be positive or None, got {median_us!r}")
    if valid and median_us is None:
        raise ValueError("record: a valid record needs median_us")
    rec = {"system": system, "world_size": world_size, "emulated": bool(emulated), "dtype": dtype,
           "hidden": hidden, "top_k": top_k, "shared": bool(shared), "profile": profile, "tokens": tokens,
           "median_us": None if median_us is None else float(median_us), "roofline_us": float(roofline_us),
           "valid": bool(valid)}
    rec.update(extra)
    return rec


def input_sets_for(bytes_per_set: int, l2_bytes: int, calls: int) -> int:
    """How many input sets the captured calls rotate through: enough that the sets together are
    at least twice the L2 (so a call does not find the previous call's inputs cached), at most
    one per call."""
    return max(1, min(calls, -(-2 * l2_bytes // max(1, bytes_per_set))))


# ---- summary -----------------------------------------------------------------------------------

def _point_key(r):
    return (r["hidden"], r["top_k"], r["shared"], r["profile"], r["tokens"])


def summary_rows(records: list[dict]) -> list[dict]:
    """Per shape / profile / tokens: auto, the baselines, the best forced program, their ratios
    and auto's fraction of the roofline."""
    points: dict = {}
    shape_order: dict = {}
    for r in records:
        points.setdefault(_point_key(r), []).append(r)
        shape_order.setdefault(_point_key(r)[:3], len(shape_order))
    rows = []
    # shapes in the order measured, then profile, then tokens
    for key in sorted(points, key=lambda k: (shape_order[k[:3]], k[3], k[4])):
        recs = points[key]
        ok = [r for r in recs if r["valid"] and r["median_us"] is not None]

        def best(pred):
            cands = [r for r in ok if pred(r)]
            return min(cands, key=lambda r: r["median_us"]) if cands else None

        auto = best(lambda r: r["system"] == "auto")
        nccl = best(lambda r: r["system"] == "nccl+torch")
        symm = best(lambda r: r["system"] == "symm+torch")
        nccl_c = best(lambda r: r["system"] == "nccl+compiled")
        symm_c = best(lambda r: r["system"] == "symm+compiled")
        base = best(lambda r: r["system"] in UNFUSED_BASELINES)
        prog = best(lambda r: r["system"] not in ("auto",) + BASELINES)
        hidden, top_k, shared, profile, tokens = key
        rows.append({
            "hidden": hidden, "top_k": top_k, "shared": shared, "profile": profile, "tokens": tokens,
            "auto_us": auto and auto["median_us"], "auto_program": auto and auto.get("program"),
            "nccl_torch_us": nccl and nccl["median_us"],
            "symm_torch_us": symm and symm["median_us"], "symm_variant": symm and symm.get("variant"),
            "nccl_compiled_us": nccl_c and nccl_c["median_us"],
            "symm_compiled_us": symm_c and symm_c["median_us"],
            "best_baseline": base and base["system"] + (f"/{base['variant']}" if base.get("variant") else ""),
            "best_baseline_us": base and base["median_us"],
            "best_program": prog and prog["system"], "best_program_us": prog and prog["median_us"],
            "auto_vs_nccl": auto and auto.get("ratio_vs_nccl_torch"),
            "auto_vs_symm": auto and auto.get("ratio_vs_symm_torch"),
            "auto_vs_best_baseline": auto and auto.get("ratio_vs_best_baseline"),
            "auto_vs_best": auto and auto.get("ratio_vs_best_program"),
            "auto_vs_plus_quant": auto and auto.get("ratio_vs_auto_plus_quant"),
            "auto_vs_auto_110": auto and auto.get("ratio_of_medians_vs_auto_110"),
            "roofline_us": (auto or recs[0])["roofline_us"],
            "roofline_fraction": auto and auto["roofline_us"] / auto["median_us"],
            "invalid": sorted({r["system"] + (f"/{r['variant']}" if r.get("variant") else "")
                               for r in recs if not r["valid"]}),
        })
    return rows


def short_program(name: Optional[str]) -> str:
    """"moe_ar_tse_bf16_ws2_o110" -> "tse" (the family code); other names unchanged."""
    if not name:
        return "-"
    m = re.fullmatch(r"moe_ar_([a-z]+)_(?:bf16|fp16)_ws\d+_\w+", name)
    return m.group(1) if m else name


def format_summary(rows: list[dict]) -> str:
    """A fixed-width table of summary_rows; ratios are time ratios (below 1: auto is faster)."""
    def us(v):
        return f"{v:8.1f}" if v is not None else f"{'-':>8}"

    def ratio(v):
        return f"{v:6.2f}" if v is not None else f"{'-':>6}"

    head = (f"{'H/K[s]':<8} {'profile':>12} {'T':>5} {'auto':>8} {'nccl+t':>8} {'symm+t':>8} {'nccl+c':>8} "
            f"{'symm+c':>8} {'bestprog':>8} {'a/nccl':>6} {'a/symm':>6} {'a/bbl':>6} {'a/best':>6} {'a/a+q':>6} "
            f"{'a/a110':>6} {'roof':>8} {'%roof':>5} auto;best;bbl")
    lines = ["us per call; a/x = median per-replay time ratio auto/x (<1: auto faster); +t / +c = torch ops eager / "
             "under torch.compile; bbl = the fastest unfused baseline at the point; a+q = auto plain + a "
             "separate FP8 quantization kernel; a/a110 = ratio of medians, auto at this profile / auto at 110; "
             "%roof = roofline/auto; H/K[s]: hidden/top_k, s = shared expert", head, "-" * len(head)]
    for r in rows:
        shape = f"{r['hidden']}/{r['top_k']}{'s' if r['shared'] else ''}"
        frac = f"{100 * r['roofline_fraction']:5.0f}" if r["roofline_fraction"] is not None else f"{'-':>5}"
        names = (f"{short_program(r['auto_program'])};{short_program(r['best_program'])};"
                 f"{r.get('best_baseline') or '-'}")
        if r["invalid"]:
            names += " INVALID:" + ",".join(short_program(n) for n in r["invalid"])
        lines.append(f"{shape:<8} {r['profile']:>12} {r['tokens']:>5} {us(r['auto_us'])} {us(r['nccl_torch_us'])} "
                     f"{us(r['symm_torch_us'])} {us(r.get('nccl_compiled_us'))} {us(r.get('symm_compiled_us'))} "
                     f"{us(r['best_program_us'])} {ratio(r['auto_vs_nccl'])} {ratio(r['auto_vs_symm'])} "
                     f"{ratio(r.get('auto_vs_best_baseline'))} {ratio(r['auto_vs_best'])} "
                     f"{ratio(r.get('auto_vs_plus_quant'))} "
                     f"{ratio(r.get('auto_vs_auto_110'))} {us(r['roofline_us'])} {frac} {names}")
    return "\n".join(lines)


def jsonable(obj):
    """Non-finite floats (a NaN error from an unwritten output) become None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def default_out_path(machine: str, when: datetime.datetime) -> pathlib.Path:
    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", machine).strip("_") or "machine"
    return pathlib.Path("bench_results") / f"{slug}-{when.strftime('%Y%m%d-%H%M%S')}.json"


def plot(result: dict, path: pathlib.Path) -> None:
    """Latency against tokens, log-log, one line per system, one subplot per shape and profile."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in result["records"] if r["valid"] and r["median_us"] is not None]
    panels = sorted({(r["hidden"], r["top_k"], r["shared"], r["profile"]) for r in result["records"]})
    if not panels:
        return
    profiles = sorted({p[3] for p in panels})
    shapes = sorted({p[:3] for p in panels}, key=lambda s: (-s[0], -s[1], not s[2]))
    fig, axes = plt.subplots(len(shapes), len(profiles), figsize=(7 * len(profiles), 4.2 * len(shapes)),
                             squeeze=False)
    for i, shape in enumerate(shapes):
        for j, profile in enumerate(profiles):
            ax = axes[i][j]
            mine = [r for r in recs if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile]
            lines: dict = {}
            for r in mine:
                label = r["system"] + (f" ({r['variant']})" if r.get("variant") else "")
                lines.setdefault(label, []).append((r["tokens"], r["median_us"]))
            for label in sorted(lines, key=lambda s: (s != "auto", s not in BASELINES and "+" not in s, s)):
                pts = sorted(lines[label])
                forced = label != "auto" and "+" not in label
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                        linestyle="--" if forced else "-", linewidth=1 if forced else 2, label=label)
            roof = sorted({(r["tokens"], r["roofline_us"]) for r in result["records"]
                           if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile
                           and r["system"] == "auto"})
            if roof:
                ax.plot([p[0] for p in roof], [p[1] for p in roof], "k:", label="roofline")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"H {shape[0]}, top_k {shape[1]}, {'shared' if shape[2] else 'no shared'}, "
                         f"profile {profile}", fontsize=10)
            ax.set_xlabel("tokens")
            ax.set_ylabel("us per call")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['machine']} ({result['gpu']}, world {result['world_size']}, {result['dtype']}) "
                 f"{result['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# =================================================================================================
# GPU side. Everything below runs in the worker processes (one per GPU) or launches them.
# =================================================================================================

def _set_required_env() -> None:
    os.environ.update(REQUIRED_ENV)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from cupy.cuda import runtime
        v = runtime.driverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - metadata only
        return "unknown"


def _versions() -> dict:
    import torch
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import cupy
        versions["cupy"] = cupy.__version__
    except ImportError:
        versions["cupy"] = None
    try:
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - metadata only
        versions["nccl"] = None
    return versions


@dataclass
class Config:
    world: int
    shapes: list
    tokens: list
    profiles: list
    dtype: str
    systems: list
    reps: int
    calls: int
    warmup: int
    out: Optional[str]
    machine: Optional[str]
    timeout_s: float
    seed: int
    bw_gib: float
    time_budget_s: float
    started: float
    init_method: str = ""
    cold_start: Optional[dict] = None
    pdl: bool = False                       # fused calls with programmatic dependent launch
    vec_per_thread: Optional[int] = None    # the workspaces' row split (None: the default)


# ---- bandwidth ---------------------------------------------------------------------------------

def measure_bandwidth(world: int, gib: float, reps: int = 10) -> dict:
    """Measured on rank 0 while the other ranks wait on the CPU.

    hbm_GBps     a device-to-device copy of `gib` GiB on GPU 0, read + write bytes counted
    nvlink_GBps  a copy of `gib` GiB from GPU 0 to GPU 1 (one way, copy engines over NVLink)
    Each the median of `reps` copies after two warm-up copies."""
    import torch
    nbytes = int(gib * 2 ** 30)
    out = {"bytes": nbytes, "reps": reps}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    out["hbm_GBps"] = 2 * nbytes / median(times) / 1e9
    del dst
    if world >= 2 and torch.cuda.device_count() >= 2:
        peer = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        times = []
        for i in range(reps + 2):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            peer.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out["nvlink_GBps"] = nbytes / median(times) / 1e9
        out["nvlink_method"] = "tensor copy cuda:0 -> cuda:1, host-timed with device synchronizes"
        del peer
    else:
        out["nvlink_GBps"] = None
    del src
    for d in range(min(2, torch.cuda.device_count())):  # give back this process's copy buffers
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
    return out


# ---- inputs and reference ----------------------------------------------------------------------

@dataclass
class InputSet:
    """One call's inputs on this rank (routing, scales, residual and gamma equal on every rank)."""
    allreduce_in: object
    idx: object
    scale: object
    shared: object
    residual: object
    norm_weight: object


def _generator(device, seed: int, *key) -> object:
    """A torch generator seeded from (seed, key): the same on every rank for the same key."""
    import torch
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(repr(key).encode())) % (2 ** 63))
    return generator


def make_input_sets(shape: Shape, tokens: int, count: int, dtype, rank: int, seed: int, device) -> list[InputSet]:
    """`count` random input sets. No route is dropped (every route reads its row)."""
    import torch
    T, H, K = tokens, shape.hidden, shape.top_k
    sets = []
    for set_index in range(count):
        common = _generator(device, seed, "common", H, K, T, set_index)  # the same on every rank
        own = _generator(device, seed, "rank", rank, H, K, T, set_index)  # this rank's
        idx = torch.randperm(T * K, generator=common, device=device).view(T, K).to(torch.int32)
        scale = torch.rand(T, K, generator=common, device=device) + 0.05
        scale /= scale.sum(-1, keepdim=True)  # top-k renormalized router weights, fp32
        residual = torch.randn(T, H, generator=common, device=device, dtype=dtype)
        norm_weight = (1 + 0.1 * torch.randn(H, generator=common, device=device)).to(dtype)
        allreduce_in = (0.5 * torch.randn(T * K, H, generator=own, device=device, dtype=dtype))
        shared = (0.5 * torch.randn(T, H, generator=own, device=device, dtype=dtype)) if shape.shared else None
        sets.append(InputSet(allreduce_in, idx, scale, shared, residual, norm_weight))
    return sets


def contract_outputs(inputs: InputSet, dtype, group) -> tuple:
    """(residual_out, norm_out) of the precision contract as float32 tensors: this rank's partial in
    float64 rounded to dtype once (not at world size 1, where nothing travels), the cross-rank sum in
    float64 (an NCCL float64 all_reduce), residual_out rounded to dtype once, RMSNorm of it in float64
    (moe_ar_tools.reference's functions). Collective over `group`."""
    import torch.distributed as dist
    from moe_ar_tools import reference as ref
    partial = ref.finalize_partial(inputs.allreduce_in, inputs.idx, inputs.scale, ROUTED_SCALING_FACTOR,
                                   inputs.shared)
    total = partial if dist.get_world_size(group) == 1 else ref.round_to_dtype(partial, dtype).double()
    del partial
    dist.all_reduce(total, group=group)
    residual = ref.round_to_dtype(total + inputs.residual.double(), dtype)
    del total
    norm = ref.rmsnorm_f64(residual, inputs.norm_weight, EPS, 0)
    return residual.float(), norm.float()


def rel_err(x, want) -> float:
    """||x - want|| / ||want|| (NaN when x holds NaN)."""
    import torch
    diff = torch.linalg.vector_norm(x.float() - want)
    norm = torch.linalg.vector_norm(want)
    return float(diff / norm) if float(norm) > 0 else float(diff)


# ---- systems -----------------------------------------------------------------------------------

@dataclass
class System:
    """One competitor at one point: a step function (one call on input set i) and its outputs."""
    name: str                      # the record's `system`
    regime: str                    # exchange regime for the NVLink bytes: one_shot / two_shot
    call: Callable[[int], None]
    outputs: list                  # per input set: dict of output tensors
    variant: Optional[str] = None  # symm+torch: one_shot / two_shot
    program: Optional[str] = None  # the generated program the call runs
    graph: object = None
    checks: dict = field(default_factory=dict)
    detail: dict = field(default_factory=dict)  # extra record fields

    @property
    def label(self) -> str:
        return self.name + (f"/{self.variant}" if self.variant else "")


def finalize_into(partial, allreduce_in, idx, scale, shared) -> None:
    """partial[T, H] = rsf * sum_k scale[t, k] * allreduce_in[idx[t, k]] + shared, with torch ops as
    an engine without fusion runs them: gather the rows, one batched matmul [1, K] x [K, H] per
    token (fp32 accumulation, dtype output), add the shared expert. Tensors only, so that
    torch.compile traces it as is (compiled_fns)."""
    import torch
    T, K = idx.shape
    H = allreduce_in.shape[1]
    rows = allreduce_in.index_select(0, idx.view(-1)).view(T, K, H)
    weights = (scale * ROUTED_SCALING_FACTOR).to(rows.dtype).unsqueeze(1)
    torch.bmm(weights, rows, out=partial.view(T, 1, H))
    if shared is not None:
        partial.add_(shared)


def epilogue_into(residual_out, norm_out, reduced, residual, norm_weight) -> None:
    """residual_out = reduced + residual_in; norm_out = RMSNorm (fp32 statistics, as in vLLM's
    native RMSNorm: normalize in fp32, round, multiply by gamma)."""
    import torch
    torch.add(reduced, residual, out=residual_out)
    hidden = residual_out.float()
    hidden = hidden * torch.rsqrt(hidden.square().mean(-1, keepdim=True) + EPS)
    torch.mul(hidden.to(reduced.dtype), norm_weight, out=norm_out)


def torch_finalize(inputs: InputSet, partial, fn=finalize_into) -> None:
    """finalize_into on an input set; fn: its compiled form for the +compiled baselines."""
    fn(partial, inputs.allreduce_in, inputs.idx, inputs.scale, inputs.shared)


def torch_epilogue(reduced, inputs: InputSet, out: dict, fn=epilogue_into) -> None:
    """epilogue_into on an input set; fn: its compiled form for the +compiled baselines."""
    fn(out["residual_out"], out["norm_out"], reduced, inputs.residual, inputs.norm_weight)


def compiled_fns(backend: str = "inductor") -> tuple:
    """(finalize, epilogue): finalize_into and epilogue_into under torch.compile, fullgraph and
    static shapes (compiled at each new shape's first call). Dynamo keeps one cache per code
    object, so its recompile limit is raised to hold every shape of a sweep: hitting it would
    silently fall back to eager."""
    import torch
    import torch._dynamo.config as dynamo_config
    for name, least in (("recompile_limit", 4096), ("cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 65536), ("accumulated_cache_size_limit", 65536)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), least))
    return tuple(torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
                 for fn in (finalize_into, epilogue_into))


def _alloc_outputs(tokens: int, hidden: int, dtype, quant, n_sets: int, device) -> list:
    import torch
    from dispatch.op import fp8_scale_shape, scale_out_bytes
    per_set = []
    for _ in range(n_sets):
        outs = {"norm_out": torch.empty(tokens, hidden, dtype=dtype, device=device),
                "residual_out": torch.empty(tokens, hidden, dtype=dtype, device=device)}
        if quant == "nvfp4":
            outs["quant_out"] = torch.empty(tokens, hidden // 2, dtype=torch.uint8, device=device)
            outs["scale_out"] = torch.empty(scale_out_bytes(tokens, hidden), dtype=torch.uint8, device=device)
        if quant in FP8_PROFILES:
            outs["quant_out"] = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device)
        if quant == "fp8_group128":
            outs["scale_out"] = torch.empty(fp8_scale_shape(tokens, hidden), dtype=torch.float32, device=device)
        per_set.append(outs)
    return per_set


def _poison(outputs: list) -> None:
    """NaN into float outputs, an E4M3 NaN into FP8 ones, 0xAB into byte outputs (the reference's
    poison): a check then sees what was not written."""
    from moe_ar_tools import reference as ref
    for outs in outputs:
        ref.repoison(outs)


# The separate quantization kernel of the auto+quant baseline: what an unfused engine runs after
# the plain fused step (vLLM's / SGLang's per_token_group_quant_fp8, or a static per-tensor
# quantization), written as one good kernel so that the comparison is fair: each thread quantizes
# 8 elements (one 16-byte load), 16 threads (a half warp) share a 128-element group's amax.
_FP8_QUANT_SOURCE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
template <typename D> __device__ __forceinline__ float to_f(D x);
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename D>
__device__ void fp8_quant(const D* x, unsigned char* q, float* scales, const float* tensor_scale, long long nvec,
                          int hidden) {
  const long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // nvec is a multiple of 16
  float f[8], amax = 0.f;
  if (v < nvec) {
    const uint4 raw = reinterpret_cast<const uint4*>(x)[v];
    const D* e = reinterpret_cast<const D*>(&raw);
    for (int i = 0; i < 8; ++i) { f[i] = to_f(e[i]); amax = fmaxf(amax, fabsf(f[i])); }
  }
  float s;
  if (tensor_scale != nullptr) {
    s = *tensor_scale;
  } else {
    for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = __fdiv_rn(fmaxf(amax, 1e-10f), 448.f);
  }
  if (v >= nvec) return;
  unsigned b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = __nv_cvt_float_to_fp8(fminf(fmaxf(__fdiv_rn(f[i], s), -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
  reinterpret_cast<uint2*>(q)[v] = make_uint2(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24,
                                              b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24);
  if (tensor_scale == nullptr && v % 16 == 0) scales[v / 16] = s;  // row-major [T, H/128]
}
extern "C" __global__ void fp8_quant_bf16(const __nv_bfloat16* x, unsigned char* q, float* scales,
                                          const float* tensor_scale, long long nvec, int hidden) {
  fp8_quant(x, q, scales, tensor_scale, nvec, hidden);
}
extern "C" __global__ void fp8_quant_fp16(const __half* x, unsigned char* q, float* scales,
                                          const float* tensor_scale, long long nvec, int hidden) {
  fp8_quant(x, q, scales, tensor_scale, nvec, hidden);
}
"""


class Fp8QuantKernel:
    """_FP8_QUANT_SOURCE compiled with the programs' NVRTC options and launched on torch's stream."""

    def __init__(self, device_index: int):
        import cupy
        from cupy.cuda import function
        from dispatch import registry
        capability = cupy.cuda.Device(device_index).compute_capability  # "90" for sm_90
        target = registry.TARGET_FOR_CAPABILITY[(int(capability[:-1]), int(capability[-1]))]
        cubin, _ = registry.compile_cubin(_FP8_QUANT_SOURCE, "bench_fp8_quant", target)
        with cupy.cuda.Device(device_index):
            self.module = function.Module()
            self.module.load(cubin)
            self.functions = {name: self.module.get_function(f"fp8_quant_{name}") for name in ("bf16", "fp16")}

    def __call__(self, norm_out, quant_out, scales, tensor_scale) -> None:
        """quant_out = FP8 of norm_out [T, H]; scales: [T, H/128] float32 (group scales, written) or
        None; tensor_scale: a [1] float32 device tensor (per-tensor scale, read) or None."""
        import ctypes
        import torch
        from cuda.bindings import driver as cu
        nvec = norm_out.numel() // 8
        function = self.functions["bf16" if norm_out.dtype == torch.bfloat16 else "fp16"]
        args = ((norm_out.data_ptr(), quant_out.data_ptr(), scales.data_ptr() if scales is not None else 0,
                 tensor_scale.data_ptr() if tensor_scale is not None else 0, nvec, norm_out.shape[1]),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int))
        err, = cu.cuLaunchKernel(cu.CUfunction(int(function.ptr)), -(-nvec // 256), 1, 1, 256, 1, 1, 0,
                                 cu.CUstream(torch.cuda.current_stream().cuda_stream), args, 0)
        if int(err) != 0:
            raise RuntimeError(f"fp8 quant kernel launch failed: {err}")


class SymmAllReduce:
    """torch symmetric memory (peer loads/stores; multicast disabled) for one hidden size: one
    symmetric buffer of [max_tokens, hidden] per rank, rendezvoused on the group."""

    def __init__(self, group, max_tokens: int, hidden: int, dtype, device):
        import torch
        import torch.distributed._symmetric_memory as symm_mem
        ops = getattr(torch.ops, "symm_mem", None)
        missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
        missing += [f"torch.ops.symm_mem.{n}" for n in ("one_shot_all_reduce_out", "two_shot_all_reduce_")
                    if ops is None or not hasattr(ops, n)]
        if missing:
            raise RuntimeError(f"this torch lacks {', '.join(missing)}")
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty((max_tokens, hidden), dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.ops = ops
        self.backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None


# ---- the benchmark, per worker -----------------------------------------------------------------

class Bench:
    """One rank's part of the sweep. Every collective decision (skip, stop) is agreed over gloo so
    that all ranks enqueue the same sequence of communicating kernels."""

    def __init__(self, cfg: Config, rank: int, gloo):
        import torch
        import torch.distributed as dist
        self.cfg, self.rank, self.gloo = cfg, rank, gloo
        self.group = dist.group.WORLD
        self.W = cfg.world
        self.device = torch.device("cuda", rank)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        self.max_tokens = max(cfg.tokens)
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)
        self.records: list = []
        self.skipped: list = []
        self.workspaces: dict = {}
        self.symm: dict = {}
        self.compiled = None        # (finalize, epilogue) under torch.compile, made at first use
        self.compile_failed = False  # a compile failure turns the +compiled baselines off for the run
        self.truncated = False

    # -- agreement helpers (CPU collectives; never touch the GPU stream) --
    def all_true(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist
        every = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.gloo)
        return bool(every.item())

    def gather(self, obj) -> list:
        import torch.distributed as dist
        out = [None] * self.W
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def broadcast(self, obj):
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.gloo)
        return box[0]

    def all_gather(self, t):
        """[W, *t.shape]: every rank's t, over the device group (a tensor collective)."""
        import torch
        import torch.distributed as dist
        out = torch.empty(self.W * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, t.contiguous().reshape(-1), group=self.group)
        return out.view(self.W, *t.shape)

    def barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.gloo)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def skip(self, reason: str, **where) -> None:
        if self.rank == 0:
            self.skipped.append(dict(where, reason=reason))

    # -- setup --
    def programs_for(self, profile: str) -> list[str]:
        import dispatch
        from dispatch.op import profile_for_quant
        manifest_profile = profile_for_quant(PROFILES[profile])  # the manifest names profiles by quant=
        out = []
        for name in dispatch.programs():
            info = dispatch.program_info(name)
            if (info["dtype"], info["world_size"], info["profile"]) == (self.cfg.dtype, self.W, manifest_profile):
                out.append(name)
        return out

    def compile_programs(self) -> list:
        """Compile (or load from the disk cache) every program the sweep may run: each rank
        compiles its share, then every rank loads all of them (from the cache)."""
        import dispatch
        names = sorted({n for p in self.cfg.profiles for n in self.programs_for(p)})
        mine = dispatch.warmup(names[self.rank::self.W], device_index=self.rank)
        self.barrier()
        dispatch.warmup(names, device_index=self.rank)
        self.barrier()
        return [i for infos in self.gather(mine) for i in infos]

    def workspace(self, hidden: int):
        import dispatch
        if hidden not in self.workspaces:
            # the sweeps force the one-shot up to 1,024 tokens (to fit the tables): more than the
            # default capacity, which is the committed tables' one-shot boundary
            self.workspaces[hidden] = dispatch.Workspace(self.group, self.max_tokens, hidden, self.dtype,
                                                         timeout_s=self.cfg.timeout_s,
                                                         oneshot_max_tokens=min(self.max_tokens, 1024),
                                                         vec_per_thread=self.cfg.vec_per_thread)
        return self.workspaces[hidden]

    def fp8_quant_kernel(self) -> "Fp8QuantKernel":
        if getattr(self, "_fp8_quant", None) is None:
            self._fp8_quant = Fp8QuantKernel(self.device.index)
        return self._fp8_quant

    def symm_for(self, hidden: int):
        """The symmetric-memory buffer for this hidden, or None (the reason is recorded once)."""
        if hidden not in self.symm:
            try:
                obj, err = SymmAllReduce(self.group, self.max_tokens, hidden, self.dtype, self.device), None
            except Exception as e:  # noqa: BLE001 - any failure means: no symm baseline here
                obj, err = None, f"{type(e).__name__}: {e}"
            if not self.all_true(obj is not None):
                errs = [e for e in self.gather(err) if e]
                self.skip("symmetric memory unavailable: " + "; ".join(errs[:2]),
                          system="symm+torch,symm+compiled", hidden=hidden)
                obj = None
            self.symm[hidden] = obj
        return self.symm[hidden]

    def compiled_for(self, T: int, H: int, inputs: InputSet, where: dict):
        """The compiled (finalize, epilogue), compiled for this point's shapes by one call on scratch
        tensors (setup, outside the timing), or None when torch.compile failed on some rank (the
        reason recorded once; the +compiled baselines are then off for the rest of the run)."""
        import torch
        if self.compile_failed:
            return None
        err = None
        try:
            if self.compiled is None:
                self.compiled = compiled_fns()
            partial = torch.empty(T, H, dtype=self.dtype, device=self.device)
            outs = _alloc_outputs(T, H, self.dtype, None, 1, self.device)[0]
            torch_finalize(inputs, partial, self.compiled[0])
            torch_epilogue(partial, inputs, outs, self.compiled[1])
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any failure means: no compiled baseline here
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not self.all_true(err is None):
            errs = [e for e in self.gather(err) if e]
            self.skip("torch.compile failed (compiled baselines off for the rest of the run): " +
                      "; ".join(errs[:2]), system=",".join(COMPILED_SYSTEMS), **where)
            self.compile_failed = True
            return None
        return self.compiled

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
        if profile == "110" and wanted & set(COMPILED_SYSTEMS):
            compiled = self.compiled_for(T, H, sets[0], where)
            if compiled is not None:
                flavours.append(("compiled",) + tuple(compiled))
        for flavour, fin, epi in flavours if profile == "110" else ():
            if f"nccl+{flavour}" in wanted:
                partial = torch.empty(T, H, dtype=dtype, device=device)
                outs = _alloc_outputs(T, H, dtype, None, n_sets, device)

                def nccl_step(i, partial=partial, outs=outs, fin=fin, epi=epi):
                    torch_finalize(sets[i], partial, fin)
                    dist.all_reduce(partial, group=self.group)
                    torch_epilogue(partial, sets[i], outs[i], epi)
                systems.append(System(f"nccl+{flavour}", "two_shot", nccl_step, outs))

            symm = self.symm_for(H) if f"symm+{flavour}" in wanted else None
            if symm is not None:
                buf = symm.buffer[:T]
                reduced = torch.empty(T, H, dtype=dtype, device=device)
                outs1 = _alloc_outputs(T, H, dtype, None, n_sets, device)
                outs2 = _alloc_outputs(T, H, dtype, None, n_sets, device)

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
            outs = _alloc_outputs(T, H, dtype, quant, n_sets, device)
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
            outs = _alloc_outputs(T, H, dtype, quant, n_sets, device)
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
            outs = _alloc_outputs(T, H, dtype, quant, n_sets, device)
            systems.append(System(name, regime_of_family(info["family"]), fused(name, outs), outs, program=name))
        return systems

    def capture(self, system: System, n_sets: int) -> Optional[str]:
        """Eager warm-up calls, then one CUDA graph of `calls` back-to-back calls rotating over
        the input sets. Returns an error string, or None."""
        import torch
        try:
            for i in range(max(self.cfg.warmup, n_sets)):
                system.call(i % n_sets)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for i in range(self.cfg.calls):
                    system.call(i % n_sets)
            torch.cuda.synchronize(self.device)
            system.graph = graph
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
            res_err = max(res_err, rel_err(outs["residual_out"], res_ref))
            norm_err = max(norm_err, rel_err(outs["norm_out"], norm_ref))
            if quant == "nvfp4":
                T, H = outs["norm_out"].shape
                deq = ref.nvfp4_dequant(outs["quant_out"], outs["scale_out"], gs_value, T, H)
                q_err = max(q_err, rel_err(deq, outs["norm_out"].float()))
            if quant in FP8_PROFILES:
                deq = outs["quant_out"].float() * (outs["scale_out"].repeat_interleave(128, dim=1)
                                                   if quant == "fp8_group128" else self.fp8_scale_value)
                q_err = max(q_err, rel_err(deq, outs["norm_out"].float()))
            for tensor in outs.values():  # bit identity across ranks
                mine = tensor.reshape(-1).view(torch.uint8)
                identical &= bool((self.all_gather(mine) == mine).all())
        ok_num = all(math.isfinite(v) for v in (res_err, norm_err, q_err))
        reasons = []
        if not (ok_num and res_err <= tol):
            reasons.append(f"residual_out rel err {res_err:.3g} > {tol:.3g}")
        if not (ok_num and norm_err <= tol):
            reasons.append(f"norm_out rel err {norm_err:.3g} > {tol:.3g}")
        if quant == "nvfp4" and not (ok_num and q_err <= NVFP4_TOLERANCE):
            reasons.append(f"nvfp4 dequant rel err {q_err:.3g} > {NVFP4_TOLERANCE}")
        if quant in FP8_PROFILES and not (ok_num and q_err <= FP8_TOLERANCE):
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
            merged[key] = max(vals, key=lambda v: (math.isnan(v), v)) if vals else None
        return merged

    def timed_loop(self, systems: list[System]) -> list[list[float]]:
        """reps rounds; in each round every system's graph is replayed once, in an order shuffled
        per round (replay_orders). Per replay: CUDA events on this rank; after the loop, the
        per-replay times of all ranks are gathered and the maximum taken. Returns [system][replay]
        microseconds per call."""
        import torch
        reps, n = self.cfg.reps, len(systems)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                  for _ in range(n)]  # [system][replay] -> (start, end)
        for replay, order in enumerate(replay_orders(n, reps, self.cfg.seed)):
            for j in order:
                start, end = events[j][replay]
                start.record()
                systems[j].graph.replay()
                end.record()
        torch.cuda.synchronize(self.device)
        ms = torch.tensor([[start.elapsed_time(end) for start, end in row] for row in events], dtype=torch.float64,
                          device=self.device)
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
            _poison(system.outputs)
        for _ in range(2):
            for system in ready:
                system.graph.replay()
        torch.cuda.synchronize(self.device)
        for system in ready:
            system.checks["before"] = self.agree_checks(self.check(system, refs, gs_value, quant))
            _poison(system.outputs)
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
                           and r["profile"] == "110" and (r["hidden"], r["top_k"], r["shared"], r["tokens"])
                           == (shape.hidden, shape.top_k, shape.shared, T)), None)
        # NVFP4 has no torch baseline; the plain (profile 110) unfused step at this point, timed in
        # its own leg, tells what the fused step with quantization costs against it.
        plain_nccl = next((r["median_us"] for r in self.records if r["system"] == "nccl+torch" and r["valid"]
                           and r["profile"] == "110" and (r["hidden"], r["top_k"], r["shared"], r["tokens"])
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
            if profile != "110" and plain_nccl is not None:
                extra["ratio_of_medians_vs_nccl_torch_110"] = med[id(system)] / plain_nccl
            if profile != "110" and plain_auto is not None:
                extra["ratio_of_medians_vs_auto_110"] = med[id(system)] / plain_auto
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
                shared=shape.shared, profile=profile, tokens=T, median_us=med[id(system)],
                roofline_us=roof["roofline_us"], valid=valid[id(system)],
                regime=system.regime, p10_us=percentile(replay_us, 10), p90_us=percentile(replay_us, 90),
                min_us=min(replay_us),
                roofline_fraction=roof["roofline_us"] / med[id(system)], bound=roof["bound"],
                hbm_bytes=hbm["total"], nvlink_bytes=nvlink, hbm_us=roof["hbm_us"], nvlink_us=roof["nvlink_us"],
                reps=self.cfg.reps, calls_per_graph=self.cfg.calls, input_sets=n_sets,
                errors={"before": {k: v for k, v in system.checks["before"].items() if k != "reasons"},
                        "after": {k: v for k, v in system.checks["after"].items() if k != "reasons"}},
                **({"invalid_reason": "; ".join(reasons)} if reasons else {}), **extra))

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
            result = {"machine": machine, "gpu": gpu, "driver": _driver_version(), "versions": _versions(),
                      "commit": git_commit(), "date": now.isoformat(timespec="seconds"),
                      "world_size": self.W, "emulated": False, "dtype": cfg.dtype,
                      "env": {k: os.environ.get(k) for k in REQUIRED_ENV},
                      "config": {"shapes": [s.label for s in cfg.shapes], "tokens": cfg.tokens,
                                 "profiles": cfg.profiles, "systems": cfg.systems, "reps": cfg.reps,
                                 "calls_per_graph": cfg.calls, "warmup": cfg.warmup,
                                 "routed_scaling_factor": ROUTED_SCALING_FACTOR, "eps": EPS,
                                 "dropped_routes": 0, "expert_scale_factor": "float32",
                                 "tolerance": {"rel_u": TOLERANCE_U, "nvfp4_rel": NVFP4_TOLERANCE,
                                               "reference": "float64 (partials rounded to dtype once)"},
                                 "l2_bytes": self.l2_bytes, "max_tokens": self.max_tokens,
                                 "launch_with_pdl": cfg.pdl, "vec_per_thread": cfg.vec_per_thread},
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
            self.log(f"time budget of {cfg.time_budget_s:.0f} s reached: the sweep stopped early")
        for ws in self.workspaces.values():
            ws.close()
        if self.rank == 0:
            self.write(result, out, final=True)
            table = format_summary(summary_rows(self.records))
            out.with_suffix(".summary.txt").write_text(table + "\n")
            print(table, flush=True)
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
                over_budget = time.time() - cfg.started > cfg.time_budget_s if self.rank == 0 else None
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

    def write(self, result: dict, out: pathlib.Path, final: bool) -> None:
        result.update(records=self.records, skipped=self.skipped, complete=final and not self.truncated,
                      truncated=self.truncated, wall_s=time.time() - self.cfg.started)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(jsonable(result), indent=1, allow_nan=False))
        os.replace(tmp, out)
        if final:
            try:
                plot(result, out.with_suffix(".png"))
                print(f"wrote {out.with_suffix('.png')}", flush=True)
            except Exception as e:  # noqa: BLE001 - the JSON is what matters
                print(f"plot failed: {type(e).__name__}: {e}", flush=True)


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


def _worker(rank: int, cfg: Config) -> None:
    """One process per GPU: NCCL group over TCP on localhost, a gloo group for CPU agreement."""
    _set_required_env()
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    # Timeouts: a deadlock fails (and mp.spawn stops the other ranks) instead of hanging the run.
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("nccl", init_method=cfg.init_method, rank=rank, world_size=cfg.world,
                            device_id=torch.device("cuda", rank), timeout=timeout)
    try:
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        Bench(cfg, rank, gloo).run()
        dist.barrier(group=gloo)
    finally:
        dist.destroy_process_group()


# ---- cold start --------------------------------------------------------------------------------

_COLD_START_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
import torch, dispatch
torch.cuda.init()
t1 = time.perf_counter()
info = dispatch.warmup([sys.argv[1]], device_index=0)
print("RESULT " + json.dumps({"import_s": t1 - t0, "warmup": info}))
"""


def measure_cold_start(program: str) -> dict:
    """Seconds to get `program` ready at first use: compiled with NVRTC into an empty temporary
    MOE_AR_CACHE_DIR (fresh process), then loaded from that warm cache (another fresh process)."""
    out = {"program": program}
    with tempfile.TemporaryDirectory(prefix="moe_ar_cold_") as cache:
        env = dict(os.environ, MOE_AR_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        for phase in ("cold", "warm"):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _COLD_START_SNIPPET, program], env=env,
                                  cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
            wall = time.perf_counter() - t0
            line = next((text for text in proc.stdout.splitlines() if text.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                out[phase] = {"error": (proc.stderr or proc.stdout)[-2000:], "process_s": wall}
                continue
            got = json.loads(line[len("RESULT "):])
            info = got["warmup"][0]
            out[phase] = {"source": info.get("source"), "seconds": info.get("seconds"),
                          "total_seconds": info.get("total_seconds"), "import_s": got["import_s"],
                          "process_s": wall}
    return out


# ---- command line ------------------------------------------------------------------------------

@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--world", default=2, help="processes / GPUs (one each)")
@click.option("--shapes", default=DEFAULT_SHAPES, help="HIDDEN:TOP_K[:shared], comma separated")
@click.option("--tokens", default=DEFAULT_TOKENS, help="comma separated, or a power-of-two range like 1-16384")
@click.option("--profiles", default="110,111", help="output profiles: 110 (dtype outputs), 111 (+ NVFP4), "
                                                   "fp8_group128, fp8_tensor")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16")
@click.option("--systems", default=DEFAULT_SYSTEMS,
              help="of nccl+torch, symm+torch, nccl+compiled, symm+compiled, auto, auto+quant, programs "
                   "(every generated program), or program names")
@click.option("--reps", default=50, help="timed replays per system and point (docs/measurement.md: at least 50)")
@click.option("--calls", default=10, help="back-to-back calls captured in one CUDA graph")
@click.option("--warmup", default=3, help="eager calls before capture")
@click.option("--out", default=None, help="JSON path [default: bench_results/<machine>-<date>.json]; "
                                          "the PNG plot goes beside it")
@click.option("--machine", default=None, help="machine name for the results [default: $MOE_AR_MACHINE or "
                                              "<W>x<GPU>-<hostname>]")
@click.option("--timeout-s", default=30.0, help="the workspaces' peer-wait deadline")
@click.option("--seed", default=1234)
@click.option("--bw-gib", default=2.0, help="GiB per copy in the bandwidth measurement")
@click.option("--time-budget-s", default=420.0, help="start no new token count after this many seconds "
                                                     "from launch (the JSON says truncated)")
@click.option("--cold-start/--no-cold-start", default=False,
              help="also measure compiling one program at first use and loading it from the warm cache")
@click.option("--cold-start-program", default=None, help="[default: the auto choice at 1 token, profile 110]")
@click.option("--sweep/--no-sweep", default=True, help="run the latency sweep")
@click.option("--pdl/--no-pdl", default=False, help="launch the fused calls with programmatic dependent launch")
@click.option("--vec-per-thread", type=click.IntRange(1, 4), default=None,
              help="the workspaces' row split: 16-byte vectors per thread [default: the runtime's]")
def main(world, shapes, tokens, profiles, dtype, systems, reps, calls, warmup, out, machine, timeout_s, seed,
         bw_gib, time_budget_s, cold_start, cold_start_program, sweep, pdl, vec_per_thread):
    """Benchmark the fused MoE finalize + all-reduce + RMSNorm programs against NCCL and torch
    symmetric-memory baselines on `--world` GPUs of this machine (docs/measurement.md)."""
    started = time.time()
    _set_required_env()
    try:
        cfg = Config(world=world, shapes=parse_shapes(shapes), tokens=parse_tokens(tokens),
                     profiles=parse_list(profiles, PROFILES, "profile"), dtype=dtype,
                     systems=parse_list(systems, what="system"), reps=reps, calls=calls, warmup=warmup, out=out,
                     machine=machine, timeout_s=timeout_s, seed=seed, bw_gib=bw_gib, time_budget_s=time_budget_s,
                     started=started, pdl=pdl, vec_per_thread=vec_per_thread)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if reps < 50:
        click.echo(f"note: --reps {reps} is below the 50 of docs/measurement.md", err=True)
    import dispatch
    for s in cfg.systems:
        if s not in SYSTEM_CHOICES and s not in dispatch.programs():
            raise click.BadParameter(f"system {s!r}: not one of {', '.join(SYSTEM_CHOICES)} nor a program name")
    if cold_start:
        from dispatch import registry
        name = cold_start_program or registry.program_for(
            registry.select_family(dtype, world, "plain", 1, False, 1024), dtype, world, "plain")
        click.echo(f"cold start: {name} ...")
        cfg.cold_start = measure_cold_start(name)
        click.echo(json.dumps(cfg.cold_start, indent=1))
        if not sweep:
            if out:
                path = pathlib.Path(out)
            else:
                path = default_out_path(machine or os.environ.get("MOE_AR_MACHINE") or socket.gethostname(),
                                        datetime.datetime.now())
                path = path.with_name(path.stem + "-cold-start.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"commit": git_commit(), "versions": _versions(),
                                        "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                        "cold_start": cfg.cold_start}, indent=1))
            click.echo(f"wrote {path}")
    if not sweep:
        return
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < world:
        raise click.ClickException(f"--world {world} needs {world} GPUs, this machine has "
                                   f"{torch.cuda.device_count()}")
    if world < 2:
        raise click.ClickException("--world must be at least 2 (emulated worlds are not benchmarked)")
    cfg.init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_worker, args=(cfg,), nprocs=world, join=True)


if __name__ == "__main__":
    # Run the imported module's main, so that the objects handed to the spawned workers are
    # moe_ar_tools.bench.* (picklable by name), not __main__.*.
    from moe_ar_tools.bench import main as _main
    _main()
