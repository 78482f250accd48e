"""Which cells of the program space exist: the hole policy, in one table.

A cell (family, dtype, one of the family's world sizes, profile) is generated unless a rule below
makes it a hole; world size 1 and the exchange world sizes are two spaces (spec.world_sizes_of), so
a hole is always a cell where a program could stand. Selection falls back from a hole to the
family's base family (its Family record's `base`; generator/enumeration.py).
"""
from __future__ import annotations

from .spec import FAMILY_BY_NAME, PROFILE_BY_NAME, ProgramSpec

# (family, reason it is not generated, predicate over the cell).
# Reasons are printed by `gen-programs tables` next to each hole.
HOLE_RULES = (
    ("twoshot_shared", "no shared-expert prefetch at world size 2 (one-shot covers most of its range)",
     lambda s: s.world_size == 2),
    ("twoshot_early_shared", "no shared-expert prefetch at world size 2 (one-shot covers most of its range)",
     lambda s: s.world_size == 2),
    ("twoshot_early_shared", "no early shared variant from world size 8 (the early range is short there)",
     lambda s: s.world_size >= 8),
    ("twoshot_pipelined", "written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on",
     lambda s: s.world_size != 2),
    ("twoshot_pipelined_loads", "written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on",
     lambda s: s.world_size != 2),
    ("twoshot_pipelined_loads", "the row ring (twoshot_pipelined) was faster at every measured T "
                                "(bench_results/pipelined/row_ring/)",
     lambda s: PROFILE_BY_NAME[s.profile].pipelined_loads is None),
)
if any(family not in FAMILY_BY_NAME for family, _, _ in HOLE_RULES):
    raise ValueError("policy: a hole rule names no family")


def hole_reason(cell: ProgramSpec) -> str | None:
    for family, reason, rule in HOLE_RULES:
        if cell.family == family and rule(cell):
            return reason
    return None


def is_supported(cell: ProgramSpec) -> bool:
    return hole_reason(cell) is None
