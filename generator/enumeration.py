"""Which programs exist: each family's space, filtered by one predicate.

`enumerate_programs()` walks `spec.all_cells()` (every family over its own world sizes: world size
1 for the local families, the others for the exchanges; in table order) and keeps the cells
`policy.is_supported` accepts; every other cell is a hole, with the reason from
`policy.hole_reason` and the family selection falls back to: the first supported family along
the chain of base families (same protocol class, same space). World size 1 running the local
programs for every exchange rung is no hole but the selection's rule for a world without peers
(the manifest's `selection.no_peers`). (Named `enumeration`, not `enumerate`, so that importing
it never shadows the builtin.)
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from . import policy, spec
from .spec import ProgramSpec


@dataclasses.dataclass(frozen=True)
class Hole:
    spec: ProgramSpec
    reason: str
    # The family whose program runs in this cell instead: the first family along the chain of
    # base families that has this cell, same protocol class by construction.
    fallback_family: str


@dataclasses.dataclass(frozen=True)
class Enumeration:
    programs: tuple[ProgramSpec, ...]  # table order (family, dtype, world size, profile)
    holes: tuple[Hole, ...]            # table order

    def cell(self, cell: ProgramSpec) -> ProgramSpec | Hole:
        """The program in this cell, or the hole that stands there (KeyError for neither)."""
        for hole in self.holes:
            if hole.spec == cell:
                return hole
        if cell in self.programs:
            return cell
        raise KeyError(cell)


def _fallback(cell: ProgramSpec, is_supported: Callable[[ProgramSpec], bool]) -> str:
    family = cell.family
    protocol = spec.FAMILY_BY_NAME[family].protocol
    seen = [family]
    while True:
        base = spec.FAMILY_BY_NAME[family].base
        if base == family:
            raise ValueError(
                f"policy: {cell.name} is a hole in root family {family!r}, so selection has nothing "
                f"to fall back to (tried {' -> '.join(seen)}); a root family must cover every cell")
        if spec.FAMILY_BY_NAME[base].protocol != protocol:
            raise ValueError(
                f"spec: family {cell.family!r} ({protocol}) falls back to {base!r} "
                f"({spec.FAMILY_BY_NAME[base].protocol}); a fallback must run the same exchange protocol")
        seen.append(base)
        family = base
        if is_supported(dataclasses.replace(cell, family=base)):
            return base


def enumerate_programs(
    is_supported: Callable[[ProgramSpec], bool] = policy.is_supported,
    hole_reason: Callable[[ProgramSpec], str | None] = policy.hole_reason,
) -> Enumeration:
    programs, holes = [], []
    for cell in spec.all_cells():
        if is_supported(cell):
            programs.append(cell)
        else:
            reason = hole_reason(cell) or "not supported"
            holes.append(Hole(cell, reason, _fallback(cell, is_supported)))
    return Enumeration(tuple(programs), tuple(holes))
