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

# The targets (check_targets): the speed-up over the fastest baseline by token range, for the profiles
# with a fused baseline (plain and FP8); ours' fraction of the read floor from FLOOR_FROM_TOKENS; never
# slower than any baseline; NVFP4's time over plain's at the same point
SPEEDUP_BANDS = ((1, 128, 1.25), (256, 1024, 1.10))
FLOOR_FROM_TOKENS = 2048
FLOOR_FRACTION = 0.95
NVFP4_OVER_PLAIN = 1.10
# Reported with the targets, not one: points where ours launched with PDL takes more than this times
# ours without (beyond the run-to-run spread of a median, about 1 %)
PDL_SLOWER_BY = 1.02


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


def _worst(rows: list, value, lowest: bool = True):
    """(the row whose value is the lowest, or the highest, that value), (None, None) without any."""
    known = [(value(r), r) for r in rows if value(r) is not None]
    if not known:
        return None, None
    v, r = (min if lowest else max)(known, key=lambda x: x[0])
    return r, v


def check_targets(rows: list, empty_kernel_us: Optional[float]) -> list:
    """The targets per shape, L2 mode and profile: the speed-up over the fastest baseline in each of
    SPEEDUP_BANDS (plain and FP8: NVFP4 has no fused baseline), ours' fraction of the read floor from
    FLOOR_FROM_TOKENS tokens (plain and FP8; NVFP4's reported), never slower than any baseline (a point where ours has no valid time but
    a baseline has fails it), NVFP4's time over plain's (NVFP4_OVER_PLAIN); ours at one token against
    the empty kernel, with and without PDL, and the points where PDL is slower than without
    (PDL_SLOWER_BY), reported only. A check with nothing to check is None."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["hidden"], r["top_k"], r["shared"], r.get("mode", "cold"), r["profile"]), []).append(r)
    plain_us = {(g[:4], r["tokens"]): r["us"]["ours"] for g, rs in groups.items() if g[4] == "plain" for r in rs}
    out = []
    for (hidden, top_k, shared, mode, profile), rs in groups.items():
        speedup = []
        if profile != "nvfp4":
            for lo, hi, need in SPEEDUP_BANDS:
                band = [r for r in rs if lo <= r["tokens"] <= hi]
                worst, v = _worst(band, lambda r: r["speedup_vs_best_baseline"])
                speedup.append({"tokens": [lo, hi], "min": need, "worst": v, "worst_tokens": worst and worst["tokens"],
                                "points": sum(r["speedup_vs_best_baseline"] is not None for r in band),
                                "pass": None if worst is None else v >= need})
        worst, v = _worst([r for r in rs if r["tokens"] >= FLOOR_FROM_TOKENS], lambda r: r.get("floor_fraction"))
        floor = {"from_tokens": FLOOR_FROM_TOKENS, "min_fraction": FLOOR_FRACTION, "worst_fraction": v,
                 "worst_tokens": worst and worst["tokens"],
                 "pass": None if worst is None or profile == "nvfp4" else v >= FLOOR_FRACTION}  # NVFP4: reported
        slower = [{"tokens": r["tokens"], "baseline": s, "ratio": v} for r in rs for s, v in r["ratios"].items()
                  if v is not None and v < 1.0]
        missing = [r["tokens"] for r in rs if r["us"]["ours"] is None and any(r["us"][s] for s in BASELINES)]
        compared = any(v is not None for r in rs for v in r["ratios"].values())
        never_slower = {"slower": slower, "ours_missing": missing,
                        "pass": False if slower or missing else (True if compared else None)}
        nvfp4 = None
        if profile == "nvfp4":
            def over_plain(r, key=(hidden, top_k, shared, mode)):
                plain = plain_us.get((key, r["tokens"]))
                return r["us"]["ours"] / plain if plain and r["us"]["ours"] else None
            worst, v = _worst(rs, over_plain, lowest=False)
            nvfp4 = {"max": NVFP4_OVER_PLAIN, "worst": v, "worst_tokens": worst and worst["tokens"],
                     "points": sum(over_plain(r) is not None for r in rs),
                     "pass": None if worst is None else v <= NVFP4_OVER_PLAIN}
        with_pdl = [r for r in rs if r["us"].get("ours_pdl") and r["us"]["ours"]]
        pdl_slower = {"over": PDL_SLOWER_BY, "points": len(with_pdl),
                      "slower": [{"tokens": r["tokens"], "ratio": r["us"]["ours_pdl"] / r["us"]["ours"]}
                                 for r in with_pdl if r["us"]["ours_pdl"] > PDL_SLOWER_BY * r["us"]["ours"]]}
        row = next((r for r in rs if r["tokens"] == 1), None)
        one, pdl = (row["us"]["ours"], row["us"].get("ours_pdl")) if row else (None, None)
        one_token = {"ours_us": one, "ours_pdl_us": pdl, "empty_kernel_us": empty_kernel_us,
                     "over_empty": one / empty_kernel_us if one and empty_kernel_us else None,
                     "over_empty_pdl": pdl / empty_kernel_us if pdl and empty_kernel_us else None}
        out.append({"mode": mode, "hidden": hidden, "top_k": top_k, "shared": shared, "profile": profile,
                    "speedup": speedup, "floor": floor, "never_slower": never_slower, "nvfp4_vs_plain": nvfp4,
                    "one_token": one_token, "pdl_slower": pdl_slower,
                    "pass": _verdict(*(b["pass"] for b in speedup), floor["pass"], never_slower["pass"],
                                     nvfp4 and nvfp4["pass"])})
    return out


def summarize(header: dict, records: list, skipped: list, complete: bool) -> dict:
    """summary.json: the run's header (gpu, commit, copy_gbps, empty_kernel_us, ours_1_token_us,
    versions, date, config ...), the rows, the targets, what was skipped."""
    rows = summary_rows(records, header["copy_gbps"], DTYPE_BYTES[header["dtype"]], header.get("read_gbps"))
    return dict(header, rows=rows, targets=check_targets(rows, header.get("empty_kernel_us")),
                skipped=skipped, complete=complete)
