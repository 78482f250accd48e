"""What a world-size-1 run reports, without a GPU: the bytes the operation moves and its roofline,
the records (one system at one point), the summary rows (one per point), the targets and
summary.json."""
from __future__ import annotations

import math
from typing import Optional

from moe_ar_tools.bench import records
from moe_ar_tools.bench.config import DTYPE_BYTES, L2_MODES
from moe_ar_tools.bench.roofline import hbm_bytes
from moe_ar_tools.bench.timing import pair_ratio
from moe_ar_tools.bench.world_one.config import BASELINES, PROFILES, RECORD_SYSTEMS, SYSTEMS

# The targets (check_targets)
BANDWIDTH_FROM_TOKENS = 2048
BANDWIDTH_TARGET = {"plain": 0.88, "nvfp4": 0.85, "fp8_group128_row": 0.88, "fp8_group128_col": 0.88,
                    "fp8_tensor": 0.88}
SPEEDUP_GEOMEAN_TARGET = 2.0
ONE_TOKEN_EMPTY_KERNELS = 2.0


# ---- bytes and roofline ------------------------------------------------------------------------

def hbm_bytes_ws1(tokens: int, hidden: int, top_k: int, shared: bool, profile: str, elem_bytes: int = 2) -> dict:
    """Bytes the operation must move through HBM, by term: moe_ar_tools.bench.roofline.hbm_bytes (expert
    rows, routing, shared expert, residual, gamma, residual_out and norm_out, quantized outputs and scales)
    with the column-major FP8 scales counted as laid out, [H/128, roundup(T, 4)] float32."""
    from dispatch.op import fp8_scale_shape
    p = PROFILES[profile]
    terms = hbm_bytes(tokens, hidden, top_k, shared, p.bench_profile, elem_bytes)
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

def make_record(*, system: str, profile: str, tokens: int, hidden: int, top_k: int, shared: bool, dtype: str,
                valid: bool, replay_us=None, variant: Optional[str] = None, reason: Optional[str] = None,
                mode: str = "cold", **extra) -> dict:
    """One system (one variant: a compile mode, a forced program) at one point, in the records' one
    format (moe_ar_tools.bench.records.make_record, world size 1). A valid record keeps its per-replay
    times (microseconds per call), the ratios of the summary rows are taken from them; an invalid one
    carries the reason."""
    if system not in RECORD_SYSTEMS:
        raise ValueError(f"record: system {system!r}")
    if mode not in L2_MODES:
        raise ValueError(f"record: L2 mode {mode!r}")
    if valid and not replay_us:
        raise ValueError("record: a valid record needs replay_us")
    if not valid and not reason:
        raise ValueError("record: an invalid record needs the reason")
    return records.make_record(system=system, world_size=1, dtype=dtype, hidden=int(hidden), top_k=int(top_k),
                               shared=shared, profile=profile, tokens=int(tokens), valid=valid,
                               replay_us=replay_us if valid else None, keep_replays=True, profiles=PROFILES,
                               variant=variant, mode=mode, **({"reason": reason} if reason else {}), **extra)


def _point(r) -> tuple:
    return (r["hidden"], r["top_k"], r["shared"], r.get("mode", "cold"), r["profile"], r["tokens"])


def summary_rows(records: list, copy_gbps: float, elem_bytes: int = 2, read_gbps: Optional[float] = None) -> list:
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
    for key in sorted(points, key=lambda k: (order[k[:3]], L2_MODES.index(k[3]), profile_order[k[4]], k[5])):
        recs = points[key]
        hidden, top_k, shared, mode, profile, tokens = key

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
        floor = roofline_us(hbm, read_gbps) if read_gbps else None
        nulls = {}
        for s in SYSTEMS:
            if chosen[s] is None:
                why = [(f"{r['variant']}: " if r.get("variant") else "") + r.get("reason", "invalid")
                       for r in recs if r["system"] == s]
                nulls[s] = "; ".join(why) if why else "not measured"
        rows.append({
            "mode": mode, "hidden": hidden, "top_k": top_k, "shared": shared, "profile": profile, "tokens": tokens,
            "us": {s: chosen[s] and chosen[s]["median_us"] for s in SYSTEMS},
            "ratios": ratios,
            "best_baseline": fastest and fastest["system"],
            "speedup_vs_best_baseline": ratios[fastest["system"]] if fastest and ours else None,
            "hbm_bytes": hbm, "roofline_us": roof,
            "roofline_fraction": roof / ours["median_us"] if ours else None,
            "floor_us": floor, "floor_fraction": floor / ours["median_us"] if ours and floor else None,
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
        groups.setdefault((r["hidden"], r["top_k"], r["shared"], r.get("mode", "cold"), r["profile"]), []).append(r)
    out = []
    for (hidden, top_k, shared, mode, profile), rs in groups.items():
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
        out.append({"mode": mode, "hidden": hidden, "top_k": top_k, "shared": shared, "profile": profile,
                    "bandwidth": bandwidth, "never_slower": never_slower, "geomean_speedup": geomean,
                    "one_token": one_token,
                    "pass": _verdict(bandwidth["pass"], never_slower["pass"], geomean["pass"], one_token["pass"])})
    return out


def summarize(header: dict, records: list, skipped: list, complete: bool) -> dict:
    """summary.json: the run's header (gpu, commit, copy_gbps, empty_kernel_us, ours_1_token_us,
    versions, date, config ...), the rows, the targets, what was skipped."""
    rows = summary_rows(records, header["copy_gbps"], DTYPE_BYTES[header["dtype"]], header.get("read_gbps"))
    return dict(header, rows=rows, targets=check_targets(rows, header.get("empty_kernel_us")),
                skipped=skipped, complete=complete)
