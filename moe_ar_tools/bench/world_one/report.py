"""World size 1's report: the short table (table.md, printed at the end) and the plot's panels
(latency.png) of a run's summary."""
from __future__ import annotations

import pathlib
from typing import Optional

from moe_ar_tools.bench.plotting import Line, Panel, draw
from moe_ar_tools.bench.config import L2_MODES
from moe_ar_tools.bench.world_one.config import PROFILES, SYSTEMS, TARGET_SHAPE
from moe_ar_tools.bench.world_one.summary import (FLOOR_FRACTION, FLOOR_FROM_TOKENS, NVFP4_OVER_PLAIN, PDL_SLOWER_BY,
                                                 SPEEDUP_BANDS)


def table_shapes(rows: list) -> list:
    """(hidden, top_k, shared) of every shape measured: the target shape first, then in measured order."""
    shapes = list(dict.fromkeys((r["hidden"], r["top_k"], r["shared"]) for r in rows))
    target = (TARGET_SHAPE.hidden, TARGET_SHAPE.top_k, TARGET_SHAPE.shared)
    return sorted(shapes, key=lambda shape: shape != target)


def table_shape(rows: list) -> Optional[tuple]:
    """(hidden, top_k, shared) the plot shows: the target shape if measured, else the first."""
    shapes = table_shapes(rows)
    return shapes[0] if shapes else None


def _us(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _yes(v) -> str:
    return {True: "yes", False: "**no**", None: "-"}[v]


def format_markdown(summary: dict) -> str:
    """The short table: per shape (the target first) and profile, T, ours and each baseline
    (microseconds), ours' speed-up over the fastest baseline and its fraction of the roofline; then the
    targets."""
    rows = summary["rows"]
    lines = [f"World size 1 on {summary['gpu']}, {summary['dtype']}, commit {summary['commit'][:12]}, "
             f"{summary['date']}: copy {summary['copy_gbps']:.0f} GB/s (read + write), empty kernel "
             f"{_us(summary['empty_kernel_us'])} us, ours at 1 token {_us(summary['ours_1_token_us']['no_pdl'])} us "
             f"({_us(summary['ours_1_token_us']['pdl'])} us with PDL).", ""]
    if summary.get("tables"):
        lines += ["Selection tables: " + ", ".join(f"H {hidden} {t['set']} ({t['why']})"
                                                   for hidden, t in summary["tables"].items()) + ".", ""]
    for shape in table_shapes(rows):
        lines += [f"Microseconds per call, H {shape[0]}, top_k {shape[1]}{' + shared expert' if shape[2] else ''}; "
                  "speed-up = the fastest baseline's time / ours (median of per-round ratios); torch.compile "
                  "d / s = dynamic shapes / compiled per T; flashinfer: compiled finalize + FlashInfer's norm "
                  "kernel, `-` where it has none (see summary.json `null_reasons`).", ""]
        for l2, profile in ((l2, profile) for l2 in L2_MODES for profile in PROFILES):
            mine = [r for r in rows if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile
                    and r.get("mode", "cold") == l2]
            if not mine:
                continue
            lines += [f"**{profile}**, {l2} L2", "",
                      "| T | ours | ours, PDL | triton fused | chain | torch eager | torch.compile | flashinfer | "
                      "speed-up | read floor |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in mine:
                us = r["us"]
                mode = f" ({r['compile_mode'][0]})" if r["compile_mode"] else ""
                speedup = "-" if r["speedup_vs_best_baseline"] is None else f"{r['speedup_vs_best_baseline']:.2f}x"
                frac = "-" if r.get("floor_fraction") is None else f"{100 * r['floor_fraction']:.0f}%"
                lines.append(f"| {r['tokens']} | {_us(us['ours'])} | {_us(us.get('ours_pdl'))} | "
                             f"{_us(us.get('triton_fused'))} | "
                             f"{_us(us.get('chain'))} | {_us(us['torch_eager'])} | {_us(us['torch_compile'])}{mode} | "
                             f"{_us(us['flashinfer'])} | {speedup} | {frac} |")
            lines.append("")
    bands = " and ".join(f"{need:.2f}x at {lo:,}-{hi:,} tokens" for lo, hi, need in SPEEDUP_BANDS)
    lines += [f"Targets: the fastest baseline's time over ours at least {bands} (plain and FP8; the worst point "
              f"of the range), ours at {100 * FLOOR_FRACTION:.0f}% of the read floor from {FLOOR_FROM_TOKENS:,} "
              f"tokens, never slower than any baseline, NVFP4 at most {NVFP4_OVER_PLAIN:.2f}x plain's time; one "
              f"token against the empty kernel and the points where PDL takes over {PDL_SLOWER_BY:.2f}x the time "
              "without, reported.", "",
              "| shape | profile | " + " | ".join(f"{lo:,}-{hi:,} tokens" for lo, hi, _ in SPEEDUP_BANDS) +
              f" | read floor from {FLOOR_FROM_TOKENS:,} | never slower | NVFP4 / plain | 1 token / empty kernel | "
              f"PDL over {PDL_SLOWER_BY:.2f}x without | all |",
              "|---|---|" + "---|" * (len(SPEEDUP_BANDS) + 6)]
    for t in summary["targets"]:
        bands = [f"{_yes(b['pass'])} ({b['worst']:.2f}x at {b['worst_tokens']})" if b["worst"] is not None else "-"
                 for b in t["speedup"]] or ["-"] * len(SPEEDUP_BANDS)
        f, n, nv, o = t["floor"], t["never_slower"], t["nvfp4_vs_plain"], t["one_token"]
        floor = "-" if f["worst_fraction"] is None else \
            f"{_yes(f['pass'])} ({100 * f['worst_fraction']:.0f}% at {f['worst_tokens']})"
        slower = ", ".join(f"{s['baseline']} at {s['tokens']}" for s in n["slower"][:3]) + \
            ("" if len(n["slower"]) <= 3 else ", ...")
        nsl = _yes(n["pass"]) + (f" ({slower})" if slower else "") + \
            (f" (ours missing at {n['ours_missing']})" if n["ours_missing"] else "")
        nvfp4 = "-" if not nv or nv["worst"] is None else f"{_yes(nv['pass'])} ({nv['worst']:.2f}x at {nv['worst_tokens']})"
        one = "-" if o["over_empty"] is None else \
            f"{_us(o['ours_us'])} / {_us(o['empty_kernel_us'])} us ({o['over_empty']:.2f}x" + \
            ("" if o["over_empty_pdl"] is None else f"; PDL {o['over_empty_pdl']:.2f}x") + ")"
        ps = t.get("pdl_slower") or {"points": 0, "slower": []}  # summaries written before it have none
        pdl = "-" if not ps["points"] else ", ".join(f"{s['ratio']:.2f}x at {s['tokens']}" for s in ps["slower"]) or "none"
        lines.append(f"| {t['hidden']}/{t['top_k']}{'s' if t['shared'] else ''} {t.get('mode', 'cold')} | "
                     f"{t['profile']} | {' | '.join(bands)} | {floor} | {nsl} | {nvfp4} | {one} | {pdl} | "
                     f"{_yes(t['pass'])} |")
    if summary.get("skipped"):
        lines += ["", f"{len(summary['skipped'])} points skipped (summary.json `skipped`)."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: pathlib.Path) -> None:
    """Latency against tokens, one line per system, one panel per profile, at table_shape (cold L2,
    the headline); the roofline dotted and the empty kernel dash-dotted."""
    rows = summary["rows"]
    shape = table_shape(rows)
    profiles = [p for p in PROFILES if any(r["profile"] == p for r in rows)]
    if shape is None or not profiles:
        return
    panels = []
    for profile in profiles:
        mine = [r for r in rows if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile
                and r.get("mode", "cold") == "cold"]
        lines = [Line(system, [(r["tokens"], r["us"][system]) for r in mine if r["us"][system] is not None], "-",
                      2 if system == "ours" else 1.2) for system in SYSTEMS]
        empty = summary.get("empty_kernel_us")
        panels.append(Panel(profile, [line for line in lines if line.points],
                            [(r["tokens"], r["roofline_us"]) for r in mine], "HBM roofline",
                            (empty, "empty kernel") if empty else None))
    draw([panels], path, f"world size 1, H {shape[0]} top_k {shape[1]}{' + shared' if shape[2] else ''}, "
                         f"{summary['gpu']}, {summary['dtype']}, {summary['commit'][:12]}, {summary['date']}",
         panel_size=(5.5, 4.4), title_size=10)
