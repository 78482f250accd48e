"""Selection boundaries: which regime serves a call, per table cell; the written model.

A call with T tokens in cell (dtype, world size, profile) runs the first regime of the ladder
(spec.LADDER) whose boundary its key value does not exceed:

    T <= local_max_tokens -> local, else T <= oneshot_max_tokens -> oneshot, else
    T <= early_max_tokens -> twoshot_early, else T <= twoshot_max_tokens -> twoshot, else
    T <= loads_max_tokens -> twoshot_pipelined_loads, else twoshot_pipelined

(each then swapped for its shared-expert variant where the rank has a shared operand and the
variant's cell is not a hole). A cell's boundaries are counted in tokens (the written model below)
or in bytes per rank (fitted ones, generator/fit.py); the runtime turns them into tokens for its
workspace's hidden size and dtype.

Measured boundaries come in table sets, one per kind of machine (generator/table_sets.py); the
written model below serves every cell no set measured, and every device no set matches.
World size 1 exchanges nothing: its local rungs take every T there and none (0) at the
other world sizes, where the exchanges' boundaries are fitted or modelled.
"""
from __future__ import annotations

import dataclasses

from . import spec

# ---- the written model, for cells no benchmark measured ---------------------------------
#
# One-shot moves (W-1)*T*H*2 bytes per rank over NVLink, two-shot 2*(W-1)/W*T*H*2, but two-shot
# pays one more round trip (~4.5 us more at T = 1, measured at world size 2). One-shot wins while
#   T * H * 2 * (W-1) * (1 - 2/W) / B_nvlink < 4.5 us,
# with B_nvlink = 390 GB/s (measured) and H = 7168: T < 82 at W = 4, T < 23 at W = 8, T < 9 at
# W = 16 (rounded down to a power of two; docs/nvlink-domains.md models it in more detail). At W = 2 the bytes are equal and only measurement can decide.
# Two-shot early splits each owned row into slices; it pays while the T / W owned rows alone
# do not fill the GPU (about 2 blocks on each of 132 multiprocessors): T <= 256 * W.
# The pipelined two-shot is generated for world size 2 only (generator/policy.py); where it is not,
# the two-shot serves every T above early_max_tokens.
MODEL_ONESHOT_MAX_TOKENS = {2: 64, 4: 64, 8: 16, 16: 8}
MODEL_EARLY_MAX_TOKENS = {2: 512, 4: 1024, 8: 2048, 16: 4096}
ALL_TOKENS = 2**31 - 1  # "no upper bound": the last regime a cell runs takes every larger T (or byte count)
MODEL_SOURCE = "written model"
# World size 1: the latency layout up to 256 tokens (the exchanges' few-token row split), the
# streaming layout above (bench_results/world_size_1/: on one H200 they cross between 256 and 1,024).
MODEL_LOCAL_MAX_TOKENS = 256
MODEL_WORLD_ONE = (MODEL_LOCAL_MAX_TOKENS,) + (ALL_TOKENS,) * (len(spec.BOUNDARY_FIELDS) - 1)
# The local rungs' boundaries at the other world sizes: no T.
NO_LOCAL_TOKENS = (0,) * spec.LOCAL_RUNGS

# The family that runs each rung of the ladder where the rank has no shared operand: the programs
# whose measurements decide the boundaries.
LADDER_FAMILIES = tuple(spec.family_for(regime.name, False) for regime in spec.LADDER)


def ladder_families(world_size: int) -> tuple[str, ...]:
    """The family that runs each rung at a world size: at world size 1, with no peers, every exchange
    rung runs `local` (the manifest's selection.no_peers), so a world-size-1 ladder may return to the
    latency layout after the streaming one (bench_results/world_size_1/small_hidden/: H 4096)."""
    if world_size != spec.LOCAL_WORLD_SIZE:
        return LADDER_FAMILIES
    return tuple(spec.LOCAL_FAMILY if spec.exchanges(family) else family for family in LADDER_FAMILIES)


@dataclasses.dataclass(frozen=True)
class Boundaries:
    # The upper bound of each rung's range but the last, in ladder order (spec.BOUNDARY_FIELDS),
    # counted in `key` (generator/fit.py KEYS); ALL_TOKENS: no bound.
    limits: tuple[int, ...]
    source: str
    key: str = "tokens"
    # The smallest and largest key value measured (a fitted cell), None for the written model:
    # outside it the runtime takes the next set of its chain.
    measured: tuple[int, int] | None = None
    # ((hidden, limits, measured), ...) in increasing hidden: sizes measured with boundaries of their
    # own (same key; their own measured range; generator/fit.py fit_cell_by_hidden); every other size
    # takes `limits` and `measured`.
    by_hidden: tuple = ()

    def __post_init__(self):
        for limits in (self.limits, *(limits for _, limits, _ in self.by_hidden)):
            if len(limits) != len(spec.BOUNDARY_FIELDS):
                raise ValueError(f"limits: {limits}, need one per field of {spec.BOUNDARY_FIELDS}")
            if not (0 <= limits[0] and all(low <= high <= ALL_TOKENS for low, high in zip(limits, limits[1:]))):
                raise ValueError(f"limits: {limits}, need 0 <= {' <= '.join(spec.BOUNDARY_FIELDS)} <= {ALL_TOKENS}")
        hiddens = [hidden for hidden, *_ in self.by_hidden]
        if hiddens != sorted(set(hiddens)) or any(type(h) is not int or h <= 0 for h in hiddens):
            raise ValueError(f"by_hidden: hidden sizes {hiddens}, need distinct positive ints in increasing order")

    def limits_at(self, hidden: int | None) -> tuple[int, ...]:
        """The boundaries a row of `hidden` elements takes (its own where it has them)."""
        return next((limits for own, limits, _ in self.by_hidden if own == hidden), self.limits)

    def measured_at(self, hidden: int | None) -> tuple[int, int] | None:
        """The measured range of a row of `hidden` elements (its own where it has boundaries of its own)."""
        return next((measured for own, _, measured in self.by_hidden if own == hidden), self.measured)

    def by_field(self, hidden: int | None = None) -> dict[str, int]:
        """{oneshot_max_tokens: ..., early_max_tokens: ..., ...}: the manifest's fields."""
        return dict(zip(spec.BOUNDARY_FIELDS, self.limits_at(hidden)))

    def family(self, value: int, hidden: int | None = None) -> str:
        """The ladder's family for a key value at a hidden size (before the shared-expert variant and
        hole fallback)."""
        for family, limit in zip(LADDER_FAMILIES, self.limits_at(hidden)):
            if value <= limit:
                return family
        return LADDER_FAMILIES[-1]


def model(world_size: int) -> Boundaries:
    """The written model's boundaries (tokens) for every cell of a world size."""
    if world_size == spec.LOCAL_WORLD_SIZE:
        return Boundaries(MODEL_WORLD_ONE, MODEL_SOURCE)
    return Boundaries((*NO_LOCAL_TOKENS, MODEL_ONESHOT_MAX_TOKENS[world_size], MODEL_EARLY_MAX_TOKENS[world_size],
                       ALL_TOKENS, ALL_TOKENS), MODEL_SOURCE)


def shown_limit(value: int, key: str) -> str:
    """A boundary as the tables show it: tokens as a number, bytes per rank in KiB or MiB, "all" for
    no bound."""
    if value == ALL_TOKENS:
        return "all"
    if key == "tokens" or value == 0:
        return str(value)
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return f"{value}B"
