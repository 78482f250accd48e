"""World size 2+'s report: the summary table (per shape, profile and token count, auto against the
baselines and the best forced program, with their ratios and auto's fraction of the roofline) and
the plot's panels (one per shape and profile)."""
from __future__ import annotations

import pathlib
import re
from typing import Optional

from moe_ar_tools.bench.config import PROFILES
from moe_ar_tools.bench.multi_gpu.config import BASELINES, UNFUSED_BASELINES
from moe_ar_tools.bench.plotting import Line, Panel, draw


def _point_key(r):
    return (r["hidden"], r["top_k"], r["shared"], r["profile"], r["tokens"])


def _profile_order(profile: str) -> int:
    """Profiles in PROFILES' order (plain first), unknown ones last."""
    return list(PROFILES).index(profile) if profile in PROFILES else len(PROFILES)


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
    for key in sorted(points, key=lambda k: (shape_order[k[:3]], _profile_order(k[3]), k[3], k[4])):
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
            "auto_vs_auto_plain": auto and auto.get("ratio_of_medians_vs_auto_plain"),
            "roofline_us": (auto or recs[0])["roofline_us"],
            "roofline_fraction": auto and auto["roofline_us"] / auto["median_us"],
            "invalid": sorted({r["system"] + (f"/{r['variant']}" if r.get("variant") else "")
                               for r in recs if not r["valid"]}),
        })
    return rows


def short_program(name: Optional[str]) -> str:
    """"moe_ar_twoshot_early_bf16_ws2_plain" -> "twoshot_early" (the family); other names unchanged."""
    if not name:
        return "-"
    m = re.fullmatch(r"moe_ar_([a-z_]+?)_(?:bf16|fp16)_ws\d+_\w+", name)
    return m.group(1) if m else name


def format_summary(rows: list[dict]) -> str:
    """A fixed-width table of summary_rows; ratios are time ratios (below 1: auto is faster)."""
    def us(v):
        return f"{v:8.1f}" if v is not None else f"{'-':>8}"

    def ratio(v):
        return f"{v:6.2f}" if v is not None else f"{'-':>6}"

    head = (f"{'H/K[s]':<8} {'profile':>12} {'T':>5} {'auto':>8} {'nccl+t':>8} {'symm+t':>8} {'nccl+c':>8} "
            f"{'symm+c':>8} {'bestprog':>8} {'a/nccl':>6} {'a/symm':>6} {'a/bbl':>6} {'a/best':>6} {'a/a+q':>6} "
            f"{'a/apl':>6} {'roof':>8} {'%roof':>5} auto;best;bbl")
    lines = ["us per call; a/x = median per-replay time ratio auto/x (<1: auto faster); +t / +c = torch ops eager / "
             "under torch.compile; bbl = the fastest unfused baseline at the point; a+q = auto plain + a "
             "separate FP8 quantization kernel; a/apl = ratio of medians, auto at this profile / auto at plain; "
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
                     f"{ratio(r.get('auto_vs_auto_plain'))} {us(r['roofline_us'])} {frac} {names}")
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> None:
    """Latency against tokens, one line per system (forced programs dashed), one panel per shape and
    profile."""
    recs = [r for r in result["records"] if r["valid"] and r["median_us"] is not None]
    panels = sorted({(r["hidden"], r["top_k"], r["shared"], r["profile"]) for r in result["records"]})
    if not panels:
        return
    profiles = sorted({p[3] for p in panels})
    shapes = sorted({p[:3] for p in panels}, key=lambda s: (-s[0], -s[1], not s[2]))
    grid = []
    for shape in shapes:
        row = []
        for profile in profiles:
            mine = [r for r in recs if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile]
            lines: dict = {}
            for r in mine:
                label = r["system"] + (f" ({r['variant']})" if r.get("variant") else "")
                lines.setdefault(label, []).append((r["tokens"], r["median_us"]))
            order = sorted(lines, key=lambda s: (s != "auto", s not in BASELINES and "+" not in s, s))
            forced = {label: label != "auto" and "+" not in label for label in order}
            roof = sorted({(r["tokens"], r["roofline_us"]) for r in result["records"]
                           if (r["hidden"], r["top_k"], r["shared"]) == shape and r["profile"] == profile
                           and r["system"] == "auto"})
            row.append(Panel(f"H {shape[0]}, top_k {shape[1]}, {'shared' if shape[2] else 'no shared'}, "
                             f"profile {profile}",
                             [Line(label, lines[label], "--" if forced[label] else "-", 1 if forced[label] else 2)
                              for label in order], roof))
        grid.append(row)
    draw(grid, path, f"{result['machine']} ({result['gpu']}, world {result['world_size']}, {result['dtype']}) "
                     f"{result['date']}")
