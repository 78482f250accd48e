"""The selection tables as a picture: for each table set and output profile, which family runs at
each token count and world size (generated/selection_map.svg, shown in the README). Drawn from the
same boundaries and holes as tables/selection_<set>.h, so a table diff is also a picture diff. A
set's boundaries counted in bytes per rank are drawn in tokens at the target shape's hidden size
(generator/fit.py TARGET_SHAPE) and bf16."""
from __future__ import annotations

import math

from . import fit, spec, table_sets, tuning
from .enumeration import Enumeration

MAX_TOKENS_SHOWN = 16384  # the largest T the benchmarks measure; the axis ends at twice that
DRAWN_HIDDEN, DRAWN_DTYPE = fit.TARGET_SHAPE[0], "bf16"  # the row size bytes-per-rank boundaries are drawn at
# One colour a family, in spec.FAMILIES order (colour-blind-safe palette).
PALETTE = ("#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#EE8866", "#44BB99")
LEFT, TOP, WIDTH, ROW, GAP, TITLE = 90, 28, 600, 18, 4, 22


def _runs(family: str, cell: tuple, programs: set) -> str:
    """The family whose program runs for a rung's `family` in `cell`: itself, or its base where it is a
    hole (a rung's family at world size 1 already the local one: tuning.ladder_families)."""
    while (family, *cell) not in programs and spec.FAMILY_BY_NAME[family].base != family:
        family = spec.FAMILY_BY_NAME[family].base
    return family


def drawn_tokens(bounds: tuning.Boundaries) -> tuple[int, ...]:
    """A cell's boundaries in tokens at DRAWN_HIDDEN and DRAWN_DTYPE (that size's own where it has them)."""
    limits = bounds.limits_at(DRAWN_HIDDEN)
    if bounds.key == "tokens":
        return limits
    row = fit.key_value(bounds.key, 1, DRAWN_HIDDEN, spec.DTYPE_BYTES[DRAWN_DTYPE])
    return tuple(limit if limit == tuning.ALL_TOKENS else limit // row for limit in limits)


def segments(limits: tuple[int, ...], cell: tuple, programs: set) -> list[tuple[int, int, str]]:
    """(first T, last T, family that runs) along the axis for boundaries in tokens, neighbours of
    one family merged; no shared-expert operand (the ladder's base families)."""
    out, first = [], 1
    for family, max_tokens in zip(tuning.ladder_families(cell[1]), (*limits, tuning.ALL_TOKENS)):
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


def context(sets: tuple[table_sets.TableSet, ...], enumeration: Enumeration) -> dict:
    """What templates/selection_map.svg.j2 draws: for each set, one panel a profile (a row a world
    size), one per dtype only where the dtypes' tables differ."""
    programs = {(p.family, p.dtype, p.world_size, p.profile) for p in enumeration.programs}
    dtypes = spec.DTYPES
    panels, y = [], TOP
    for table_set in sets:
        tokens = {cell: drawn_tokens(bounds) for cell, bounds in table_set.boundaries.items()}
        same = all(tokens[(dtypes[0], w, p)] == tokens[(d, w, p)]
                   for d in dtypes for w in spec.WORLD_SIZES for p in spec.OUTPUT_PROFILES)
        for dtype_label in [" and ".join(dtypes)] if same else list(dtypes):
            dtype = dtypes[0] if same else dtype_label
            for profile in spec.OUTPUT_PROFILES:
                rows, row_y = [], y + TITLE
                for world_size in spec.WORLD_SIZES:
                    cell = (dtype, world_size, profile)
                    bars = [{"x": round(_x(first), 1), "width": round(_x(last + 1) - _x(first), 1),
                             "colour": PALETTE[spec.FAMILIES.index(family)],
                             "title": f"ws{world_size} {profile}: T {first}.."
                                      f"{last if last < 2 * MAX_TOKENS_SHOWN - 1 else 'all'} -> {family}"}
                            for first, last, family in segments(tokens[cell], cell, programs)]
                    rows.append({"label": f"world size {world_size}", "y": row_y, "bars": bars})
                    row_y += ROW + GAP
                panels.append({"title": f"set {table_set.name}: {profile} ({dtype_label})", "y": y, "rows": rows})
                y = row_y + 10
    ticks = [{"x": round(_x(t), 1), "label": f"{t // 1024}K" if t >= 1024 else str(t)}
             for t in (4 ** i for i in range(8))]
    used = sorted({bar["colour"] for panel in panels for row in panel["rows"] for bar in row["bars"]})
    legend = [{"name": f.name, "title": f.title, "colour": PALETTE[i]}
              for i, f in enumerate(spec.FAMILY_BY_NAME.values()) if PALETTE[i] in used]
    for i, entry in enumerate(legend):
        entry["x"], entry["y"] = LEFT + (i % 3) * 200, y + 48 + (i // 3) * 18
    source = "; ".join(f"set {s.name}: {s.title}" for s in sets)
    return {"width": LEFT + WIDTH + 30, "height": y + 56 + 18 * ((len(legend) + 2) // 3),
            "left": LEFT, "right": LEFT + WIDTH, "row_height": ROW, "row_text_dy": ROW - 5, "axis_y": y, "ticks": ticks, "panels": panels,
            "legend": legend, "source": source, "drawn_at": f"hidden {DRAWN_HIDDEN}, {DRAWN_DTYPE}"}
