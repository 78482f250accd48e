"""The selection tables as a picture: for each output profile, which family runs at each token count
and world size (generated/selection_map.svg, shown in the README). Drawn from the same boundaries and
holes as tables/selection.h, so a table diff is also a picture diff."""
from __future__ import annotations

import math

from . import spec, tuning
from .enumeration import Enumeration

MAX_TOKENS_SHOWN = 16384  # the largest T the benchmarks measure; the axis ends at twice that
# One colour a family, in spec.FAMILIES order (colour-blind-safe palette).
PALETTE = ("#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#EE8866", "#44BB99")
LEFT, TOP, WIDTH, ROW, GAP, TITLE = 90, 28, 600, 18, 4, 22


def _runs(family: str, cell: tuple, programs: set) -> str:
    """The family whose program runs for `family` in `cell`: itself, or its base where it is a hole."""
    while (family, *cell) not in programs and spec.FAMILY_BY_NAME[family].base != family:
        family = spec.FAMILY_BY_NAME[family].base
    return family


def segments(bounds: tuning.Boundaries, cell: tuple, programs: set) -> list[tuple[int, int, str]]:
    """(first T, last T, family that runs) along the axis, neighbours of one family merged;
    no shared-expert operand (the ladder's base families)."""
    out, first = [], 1
    for family, max_tokens in zip(tuning.LADDER_FAMILIES, (*bounds.max_tokens, tuning.ALL_TOKENS)):
        last = min(max_tokens, 2 * MAX_TOKENS_SHOWN - 1)
        if last >= first:
            runs = _runs(family, cell, programs)
            if out and out[-1][2] == runs:
                out[-1] = (out[-1][0], last, runs)
            else:
                out.append((first, last, runs))
            first = last + 1
    return out


def _x(tokens: float) -> float:
    return LEFT + WIDTH * math.log2(tokens) / math.log2(2 * MAX_TOKENS_SHOWN)


def context(selection: tuning.Selection, enumeration: Enumeration) -> dict:
    """What templates/selection_map.svg.j2 draws: one panel a profile (a row a world size), one per
    dtype only where the dtypes' tables differ."""
    programs = {(p.family, p.dtype, p.world_size, p.profile) for p in enumeration.programs}
    dtypes = spec.DTYPES
    same = all(selection.boundaries[(dtypes[0], w, p)].max_tokens == selection.boundaries[(d, w, p)].max_tokens
               for d in dtypes for w in spec.WORLD_SIZES for p in spec.OUTPUT_PROFILES)
    shown_dtypes = [" and ".join(dtypes)] if same else list(dtypes)
    panels, y = [], TOP
    for dtype_label in shown_dtypes:
        dtype = dtypes[0] if same else dtype_label
        for profile in spec.OUTPUT_PROFILES:
            rows, row_y = [], y + TITLE
            for world_size in spec.WORLD_SIZES:
                cell = (dtype, world_size, profile)
                bars = [{"x": round(_x(first), 1), "width": round(_x(last + 1) - _x(first), 1),
                         "colour": PALETTE[spec.FAMILIES.index(family)],
                         "title": f"ws{world_size} {profile}: T {first}..{last if last < 2 * MAX_TOKENS_SHOWN - 1 else 'all'}"
                                  f" -> {family}"}
                        for first, last, family in segments(selection.boundaries[cell], cell, programs)]
                rows.append({"label": f"world size {world_size}", "y": row_y, "bars": bars})
                row_y += ROW + GAP
            panels.append({"title": f"{profile} ({dtype_label})", "y": y, "rows": rows})
            y = row_y + 10
    ticks = [{"x": round(_x(t), 1), "label": f"{t // 1024}K" if t >= 1024 else str(t)}
             for t in (4 ** i for i in range(8))]
    used = sorted({bar["colour"] for panel in panels for row in panel["rows"] for bar in row["bars"]})
    legend = [{"name": f.name, "title": f.title, "colour": PALETTE[i]}
              for i, f in enumerate(spec.FAMILY_BY_NAME.values()) if PALETTE[i] in used]
    for i, entry in enumerate(legend):
        entry["x"], entry["y"] = LEFT + (i % 3) * 200, y + 48 + (i // 3) * 18
    return {"width": LEFT + WIDTH + 30, "height": y + 56 + 18 * ((len(legend) + 2) // 3),
            "left": LEFT, "right": LEFT + WIDTH, "row_height": ROW, "row_text_dy": ROW - 5, "axis_y": y, "ticks": ticks, "panels": panels,
            "legend": legend, "source": selection.source}
