"""Which cells of the program space exist: the hole policy, in one table.

A cell (family, dtype, world size, profile) is generated unless a rule below
makes it a hole. Selection falls back from a hole to the family's base family
(its Family record's `base`); across the line between world size 1 and the
others, see generator/enumeration.py.
"""
from __future__ import annotations

from .spec import FAMILY_BY_NAME, LOCAL_WORLD_SIZE, PROFILE_BY_NAME, ProgramSpec, exchanges

NOTHING_TO_EXCHANGE = "nothing to exchange: the local programs (`local`, `local_streaming`) serve every T"
WORLD_ONE_ONLY = "world size 1 only: with peers the exchange families serve every T (the local boundaries are 0)"

# (family, reason it is not generated, predicate over the cell).
# Reasons are printed by `gen-programs tables` next to each hole. The world-size-1 line comes first:
# every exchange family is a hole at world size 1, every family that exchanges nothing elsewhere.
HOLE_RULES = tuple(
    (family, NOTHING_TO_EXCHANGE, lambda s: s.world_size == LOCAL_WORLD_SIZE) if exchanges(family)
    else (family, WORLD_ONE_ONLY, lambda s: s.world_size != LOCAL_WORLD_SIZE)
    for family in FAMILY_BY_NAME) + (
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


def hole_reason(cell: ProgramSpec) -> str | None:
    for family, reason, rule in HOLE_RULES:
        if cell.family == family and rule(cell):
            return reason
    return None


def is_supported(cell: ProgramSpec) -> bool:
    return hole_reason(cell) is None
