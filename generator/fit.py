"""The fit: from measured times to one cell's selection boundaries.

Input, per cell (dtype, world size, output profile): points {(hidden, top_k, shared, T): {family:
Time(median_us, noise_us)}}, every base program of the ladder that ran there. Output: the boundary
of each rung of the ladder (spec.BOUNDARY_FIELDS) in the units of a key (KEYS: tokens T, or bytes
per rank T x hidden x element bytes), the measured range of that key, and the error of the fit.

The rule, over the measured points sorted by the key (one dynamic program over the points, so the
rungs follow the ladder by construction: one crossover per rung, however the argmin flickers):

1. fewest points clearly over TARGET_SLOWDOWN x the best program (beyond both programs' noise),
   those at TARGET_SHAPE first;
2. then the smallest sum of log slowdowns, where serving a point with another family than the
   prior's (the written model) costs both programs' relative noise plus MIN_WIN more: a boundary
   moves off the prior only where the win beats the measured noise by that margin.

A family may serve a key value only where it was measured at every point there (the one-shot above
the benchmark's workspace capacity, a hole). Beyond the measured range the fit says nothing: the
runtime serves a token count outside it from the next set in its chain (dispatch/table_sets.py), so
a partial table is never stretched past what it measured.

Pure Python: no GPU, no runtime.
"""
from __future__ import annotations

import dataclasses
import math

from . import spec
from .tuning import ALL_TOKENS, LADDER_FAMILIES

# What a boundary is counted in. tokens: the call's T; bytes_per_rank: T x hidden x element bytes,
# one rank's rows (what the exchange moves and the kernels read).
KEYS = ("tokens", "bytes_per_rank")
# The key of fitted boundaries: the crossovers measured at hidden 4096 and 7168 lie at the same
# bytes per rank, not at the same T (bench_results/tuning/README.md).
FIT_KEY = "bytes_per_rank"
# The target for the automatic choice: within 5% of the best program at every measured point.
TARGET_SLOWDOWN = 1.05
# (hidden, top_k, shared expert) of the target shape (#4: H 7168, top_k 8 with the shared
# expert): a point over the target there weighs more than any number of points over it elsewhere.
TARGET_SHAPE = (7168, 8, True)
# The least relative win, beyond both programs' noise, that moves a boundary off the prior.
MIN_WIN = 0.01


@dataclasses.dataclass(frozen=True)
class Time:
    """One program at one point: the median time and its noise (the same unit)."""
    median_us: float
    noise_us: float

    def __post_init__(self):
        if not (self.median_us > 0 and math.isfinite(self.median_us)):
            raise ValueError(f"median_us: {self.median_us!r}, need a positive time")
        if not (self.noise_us >= 0 and math.isfinite(self.noise_us)):
            raise ValueError(f"noise_us: {self.noise_us!r}, need a non-negative noise")

    @property
    def relative_noise(self) -> float:
        return self.noise_us / self.median_us


def key_value(key: str, tokens: int, hidden: int, elem_bytes: int) -> int:
    """The value of `key` for a call of `tokens` tokens of `hidden` elements of `elem_bytes` bytes."""
    if key == "tokens":
        return tokens
    if key == "bytes_per_rank":
        return tokens * hidden * elem_bytes
    raise ValueError(f"key: {key!r}, one of {', '.join(KEYS)}")


def rung_of(limits, value: int) -> int:
    """The ladder index of the rung that serves `value`: the first whose limit it does not exceed."""
    return next((i for i, limit in enumerate(limits) if value <= limit), len(limits))


@dataclasses.dataclass(frozen=True)
class CellFit:
    key: str
    limits: tuple[int, ...]     # per spec.BOUNDARY_FIELDS, in `key` units; ALL_TOKENS: no bound
    measured: tuple[int, int]   # the smallest and largest key value measured
    points: int
    over: int                   # points over TARGET_SLOWDOWN x the best program
    over_at_target: int         # of them, at TARGET_SHAPE
    worst: float                # the largest slowdown against the best program
    mean: float                 # the geometric mean slowdown
    # ((hidden, limits, measured), ...): the hidden sizes whose own boundaries serve them better than
    # `limits` (fit_cell_by_hidden), with their own measured range; the counts above are then those of
    # the choice with them.
    by_hidden: tuple = ()

    def describe(self) -> str:
        own = "" if not self.by_hidden else \
            f"; own boundaries at hidden {', '.join(str(hidden) for hidden, *_ in self.by_hidden)}"
        return (f"{self.over} of {self.points} points over {TARGET_SLOWDOWN}x the best program "
                f"({self.over_at_target} at the target shape), at most {self.worst:.3f}x, mean {self.mean:.3f}x{own}")


def fit_cell(points: dict, prior: tuple[int, ...], *, key: str = FIT_KEY, elem_bytes: int = 2,
             margin: float = MIN_WIN, families: tuple[str, ...] = LADDER_FAMILIES) -> CellFit:
    """The boundaries of one cell from its points (see the module doc); `prior` holds the written
    model's boundaries of the cell in tokens; `families` the family each rung runs at the cell's world
    size (tuning.ladder_families)."""
    if not points:
        raise ValueError("points: nothing measured")
    if len(prior) != len(spec.BOUNDARY_FIELDS):
        raise ValueError(f"prior: {prior}, need one per field of {spec.BOUNDARY_FIELDS}")
    by_value: dict[int, list] = {}
    for (hidden, top_k, shared, tokens), times in points.items():
        by_value.setdefault(key_value(key, tokens, hidden, elem_bytes), []).append(
            ((hidden, top_k, shared) == TARGET_SHAPE, families[rung_of(prior, tokens)], times))
    values = sorted(by_value)
    rungs = range(len(families))
    # cost[k][r]: (points clearly over the target at the target shape, clearly over anywhere, log cost)
    # of rung r serving every point at values[k]; None where its family was not measured at all of them.
    cost = [[_cost(by_value[value], families[r], margin) for r in rungs] for value in values]
    # best[k][r]: the cheapest ladder over values[:k+1] ending on rung r, and the rung before it. The
    # cost ends with the number of rung changes: at equal times the fewer regimes win.
    best = [[(None if cost[0][r] is None else (*cost[0][r], 0), None) for r in rungs]]
    for k in range(1, len(values)):
        row = []
        for r in rungs:
            here = cost[k][r]
            options = [(_add(before, here, q != r), q) for q, (before, _) in enumerate(best[-1][:r + 1])
                       if before is not None and here is not None]
            row.append(min(options, key=lambda option: option[0]) if options else (None, None))
        best.append(row)
    ends = [r for r in rungs if best[-1][r][0] is not None]
    if not ends:
        raise ValueError("points: no family of the ladder was measured at every shape of some token count")
    chosen = [min(ends, key=lambda r: best[-1][r][0])]
    for k in range(len(values) - 1, 0, -1):
        chosen.append(best[k][chosen[-1]][1])
    chosen.reverse()
    limits = []
    for i in range(len(spec.BOUNDARY_FIELDS)):
        served = [value for value, r in zip(values, chosen) if r <= i]
        limits.append(ALL_TOKENS if chosen[-1] <= i else max(served, default=0))
    return CellFit(key, tuple(limits), (values[0], values[-1]),
                   *_score(points, lambda hidden: limits, key, elem_bytes, families))


def _slowdowns(points: dict, limits_at, key: str, elem_bytes: int,
               families: tuple[str, ...]) -> list[tuple[bool, int, float]]:
    """(at the target shape, hidden, slowdown against the best program) of every point, served by the
    boundaries limits_at(hidden)."""
    out = []
    for (hidden, top_k, shared, tokens), times in points.items():
        family = families[rung_of(limits_at(hidden), key_value(key, tokens, hidden, elem_bytes))]
        out.append(((hidden, top_k, shared) == TARGET_SHAPE, hidden,
                    times[family].median_us / min(t.median_us for t in times.values())))
    return out


def _score(points: dict, limits_at, key: str, elem_bytes: int,
           families: tuple[str, ...]) -> tuple[int, int, int, float, float]:
    """(points, over the target, of them at the target shape, worst, geometric mean) of a choice."""
    slowdowns = _slowdowns(points, limits_at, key, elem_bytes, families)
    over = [at_target for at_target, _hidden, slowdown in slowdowns if slowdown > TARGET_SLOWDOWN]
    return (len(slowdowns), len(over), sum(over), max(s for *_, s in slowdowns),
            math.exp(sum(math.log(s) for *_, s in slowdowns) / len(slowdowns)))


def fit_cell_by_hidden(points: dict, prior: tuple[int, ...], *, key: str = FIT_KEY, elem_bytes: int = 2,
                       margin: float = MIN_WIN, families: tuple[str, ...] = LADDER_FAMILIES,
                       own_families: tuple[str, ...] | None = None) -> CellFit:
    """fit_cell over every point, and, where the points hold more than one hidden size, each hidden
    size fitted on its own points alone: its boundaries are kept (CellFit.by_hidden) where they serve
    its points with fewer over the target, or a worst slowdown smaller by more than `margin`. A
    crossover that one key cannot place for every row size (the regimes' occupancy differs with the
    row's threads: bench_results/world_size_1/row_split/) is then exact where it was measured; any
    other hidden size takes the joint boundaries.

    `own_families` (default `families`): the family each rung runs for a hidden size's own boundaries.
    At world size 1 the joint ladder runs the measured rungs only (`families` = tuning.LADDER_FAMILIES:
    one crossover, the unmeasured hidden sizes' boundaries), while a measured hidden size's own may
    return to the latency layout after the streaming one (tuning.ladder_families(1)): its lead at large T
    is particular to H 4096 and 2048 (bench_results/world_size_1/small_hidden/)."""
    own_families = families if own_families is None else own_families
    joint = fit_cell(points, prior, key=key, elem_bytes=elem_bytes, margin=margin, families=families)
    own = []
    for hidden in sorted({point[0] for point in points}) if len({point[0] for point in points}) > 1 else ():
        mine = {point: times for point, times in points.items() if point[0] == hidden}
        alone = fit_cell(mine, prior, key=key, elem_bytes=elem_bytes, margin=margin, families=own_families)
        _, over_joint, _, worst_joint, _ = _score(mine, lambda h: joint.limits, key, elem_bytes, own_families)
        _, over_alone, _, worst_alone, _ = _score(mine, lambda h: alone.limits, key, elem_bytes, own_families)
        if alone.limits != joint.limits and (over_alone < over_joint or (
                over_alone == over_joint and worst_alone * (1 + margin) < worst_joint)):
            own.append((hidden, alone.limits, alone.measured))
    if not own:
        return joint
    limits_of = {hidden: limits for hidden, limits, _ in own}
    return dataclasses.replace(joint, by_hidden=tuple(own),
                               **dict(zip(("points", "over", "over_at_target", "worst", "mean"),
                                          _score(points, lambda hidden: limits_of.get(hidden, joint.limits),
                                                 key, elem_bytes, own_families))))


def _add(before: tuple, here: tuple, change: bool) -> tuple:
    """A ladder's cost (over at target, over, log cost, rung changes) with one more key value."""
    return (before[0] + here[0], before[1] + here[1], before[2] + here[2], before[3] + change)


def _cost(points: list, family: str, margin: float):
    """(clearly over the target at the target shape, clearly over, log cost) of `family` serving
    `points` [(at the target shape, the prior's family, {family: Time})]; None where it was not
    measured at one of them."""
    over_at_target = over = 0
    log_cost = 0.0
    for at_target, prior_family, times in points:
        mine = times.get(family)
        if mine is None:
            return None
        fastest = min(times.values(), key=lambda t: t.median_us)
        clearly_over = mine.median_us - mine.noise_us > TARGET_SLOWDOWN * (fastest.median_us + fastest.noise_us)
        over += clearly_over
        over_at_target += clearly_over and at_target
        log_cost += math.log(mine.median_us / fastest.median_us)
        kept = times.get(prior_family)
        if kept is not None and family != prior_family:
            log_cost += mine.relative_noise + kept.relative_noise + margin
    return (over_at_target, over, log_cost)
