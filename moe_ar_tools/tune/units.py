"""What a tune measures: one unit is every base program of one cell (world size, dtype, output
profile) at one shape and token count; a unit is measured whole or not at all, so a run stopped
part-way resumes at the next unit."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Unit:
    world_size: int
    dtype: str
    hidden: int
    top_k: int
    shared: bool
    tokens: int
    profile: str

    @property
    def key(self) -> list:
        """How the output file lists the unit among those done (JSON)."""
        return [self.world_size, self.dtype, self.hidden, self.top_k, self.shared, self.tokens, self.profile]

    @property
    def label(self) -> str:
        return (f"ws{self.world_size} {self.dtype} H{self.hidden} K{self.top_k}{' shared' if self.shared else ''} "
                f"T={self.tokens} {self.profile}")


def plan(world_sizes, dtype: str, shapes, tokens, profiles) -> list[Unit]:
    """Every unit, world size by world size, then shape, token count and profile (the profiles of
    one shape and token count share their inputs)."""
    return [Unit(world_size, dtype, shape.hidden, shape.top_k, bool(shape.shared), T, profile)
            for world_size in world_sizes for shape in shapes for T in tokens for profile in profiles]
