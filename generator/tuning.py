"""Selection boundaries: which regime serves a token count T, per table cell.

A call with T tokens in cell (dtype, world size, profile) runs the first regime of the ladder
(spec.LADDER) whose boundary T does not exceed:

    T <= local_max_tokens -> local, else T <= oneshot_max_tokens -> oneshot, else
    T <= early_max_tokens -> twoshot_early, else T <= twoshot_max_tokens -> twoshot, else
    T <= loads_max_tokens -> twoshot_pipelined_loads, else twoshot_pipelined

(each then swapped for its shared-expert variant where the rank has a shared
operand and the variant's cell is not a hole).

Where the committed benchmark named by BENCH_FILE (written by `moe-ar-bench`)
measured every base program of a cell on real GPUs, the boundaries are the ones
that best fit those measurements; every cell says where its numbers came from.
Cells with no measurement (world sizes 4 and 8: no such machine here) take the
written model below. Pointing BENCH_FILE at a new benchmark is therefore a
visible table diff. World size 1 exchanges nothing: its one regime, local, takes
every T (local_max_tokens = ALL_TOKENS), and at the other world sizes it takes
none (0); the exchanges' boundaries are fitted or modelled as before.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import pathlib

from . import spec

# The one measurement the tables are fitted to: the full benchmark of every program at every output
# profile on 2x H200 (NVLink, world size 2, bf16), four shapes, 1 to 16,384 tokens.
BENCH_FILE = "bench_results/h200x2-2026-11-30-529cb84-bf16.json"

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
ALL_TOKENS = 2**31 - 1  # "no upper bound": the last regime a cell runs takes every larger T
MODEL_SOURCE = "written model"
# World size 1: one layout, the local one, for every T (a second one, for very few tokens, would take
# the T below a boundary of its own; a benchmark at world size 1 decides that).
MODEL_WORLD_ONE = (ALL_TOKENS,) * len(spec.BOUNDARY_FIELDS)
# The local rungs' boundaries at the other world sizes: no T.
NO_LOCAL_TOKENS = (0,) * spec.LOCAL_RUNGS

# The family that runs each rung of the ladder where the rank has no shared operand: the programs
# whose measurements decide the boundaries.
LADDER_FAMILIES = tuple(spec.family_for(regime.name, False) for regime in spec.LADDER)
# A profile no benchmark measured takes the plain profile's boundaries: the exchange is the same,
# only the per-row work of the last phase differs.
BORROW_PROFILE = spec.PLAIN


@dataclasses.dataclass(frozen=True)
class Boundaries:
    # The upper bound of each rung's T range but the last, in ladder order (spec.BOUNDARY_FIELDS);
    # ALL_TOKENS: no bound.
    max_tokens: tuple[int, ...]
    source: str

    def __post_init__(self):
        if len(self.max_tokens) != len(spec.BOUNDARY_FIELDS):
            raise ValueError(f"max_tokens: {self.max_tokens}, need one per field of {spec.BOUNDARY_FIELDS}")

    def by_field(self) -> dict[str, int]:
        """{oneshot_max_tokens: ..., early_max_tokens: ..., ...}: the manifest's fields."""
        return dict(zip(spec.BOUNDARY_FIELDS, self.max_tokens))

    def family(self, tokens: int) -> str:
        """The ladder's family for T tokens (before the shared-expert variant and hole fallback)."""
        for family, max_tokens in zip(LADDER_FAMILIES, self.max_tokens):
            if tokens <= max_tokens:
                return family
        return LADDER_FAMILIES[-1]


@dataclasses.dataclass(frozen=True)
class Selection:
    source: str  # one line for the whole table
    # (dtype, world_size, profile) -> Boundaries, for every cell of the table
    boundaries: dict


def bench_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The committed benchmark result the selection reads (a generator input): BENCH_FILE."""
    path = pathlib.Path(root) / BENCH_FILE
    if not path.is_file():
        raise ValueError(f"tuning: the benchmark the tables are fitted to, {BENCH_FILE}, is missing under {root}")
    return [path]


def _program_of(system: str) -> spec.ProgramSpec | None:
    try:
        return spec.parse(system)
    except ValueError:
        return None  # a baseline or "auto"


def measured_times(paths) -> dict:
    """(dtype, world size, profile) -> {(hidden, top_k, shared, T): {family: median us}}, from the
    valid, non-emulated records of forced programs of the ladder's families. The cell is the
    program's (from its name), whatever the record calls its profile."""
    out = collections.defaultdict(lambda: collections.defaultdict(dict))
    for path in paths:
        doc = json.loads(pathlib.Path(path).read_text())
        for record in doc.get("records", []):
            program = _program_of(record["system"])
            if (program is None or program.family not in LADDER_FAMILIES or record.get("emulated")
                    or not record.get("valid", True)):
                continue
            point = (record["hidden"], record["top_k"], bool(record["shared"]), record["tokens"])
            cell = (program.dtype, program.world_size, program.profile)
            out[cell][point][program.family] = record["median_us"]
    return out


# The target for the automatic choice: within 5% of the best program at every measured point.
AUTO_TARGET_SLOWDOWN = 1.05
# (hidden, top_k, shared expert) of the targets (#4: H 7168, top_k 8 with the shared expert),
# where that target is the contract. A point over the target there weighs more than any number of
# points over it at the other shapes, which are served as well as the boundaries allow: one boundary
# per cell cannot suit every shape.
TARGET_SHAPE = (7168, 8, True)


def fit_boundaries(points: dict) -> tuple[int, int, int, int, float, float, int, int]:
    """The exchanges' boundaries (oneshot_max_tokens, early_max_tokens, twoshot_max_tokens,
    loads_max_tokens; the local rung takes no T where there is an exchange) on the measured token
    grid (the last two may also be ALL_TOKENS) with the fewest measured points slower than
    AUTO_TARGET_SLOWDOWN x the best base program there, counting those at TARGET_SHAPE first, the
    mean log slowdown breaking ties; also the worst and the mean slowdown, as ratios, and
    the number of points over the target, everywhere and at TARGET_SHAPE. A rule may pick a family
    only where that family was measured at every shape it serves."""
    # Per point: (T, at the target shape, {family: slowdown against the best program there}).
    slowdown_at = [(point[3], point[:3] == TARGET_SHAPE,
                    {family: us / min(times.values()) for family, us in times.items()})
                   for point, times in points.items()]
    token_counts = sorted({point[3] for point in points})
    best = None
    for rule in _candidate_rules(points):
        family_at = {tokens: rule.family(tokens) for tokens in token_counts}
        slowdowns, over_at_target = [], 0
        for tokens, at_target, slowdown in slowdown_at:
            family = family_at[tokens]
            if family not in slowdown:
                break
            slowdowns.append(slowdown[family])
            over_at_target += at_target and slowdowns[-1] > AUTO_TARGET_SLOWDOWN
        else:
            over = sum(x > AUTO_TARGET_SLOWDOWN for x in slowdowns)
            mean_log = sum(math.log(x) for x in slowdowns) / max(len(slowdowns), 1)
            counts = (over_at_target, over)
            if best is None or counts < best[1][:2] or (counts == best[1][:2] and mean_log < best[1][2] - 1e-12):
                best = (rule, (over_at_target, over, mean_log), max(slowdowns, default=1.0))
    if best is None:
        raise ValueError("tuning: no set of boundaries is feasible for the measured points")
    rule, (over_at_target, over, mean_log), worst = best
    return (*rule.max_tokens[spec.LOCAL_RUNGS:], worst, math.exp(mean_log), over, over_at_target)


def _candidate_rules(points: dict):
    """Every ordered set of boundaries on the measured token grid, in the order that breaks ties:
    at equal cost the first one found stays, so a tie keeps the two-shot (ALL_TOKENS first) and
    runs no T on the pipelined two-shot with register loads (loads_max_tokens == twoshot_max_tokens
    first). Where that program was not measured, only the latter."""
    candidates = [0] + sorted({point[3] for point in points})
    with_loads = any("twoshot_pipelined_loads" in times for times in points.values())
    for oneshot in candidates:
        for early in (x for x in candidates if x >= oneshot):
            for twoshot in [ALL_TOKENS] + [x for x in candidates if x >= early]:
                loads = ([x for x in candidates if x > twoshot] + [ALL_TOKENS]
                         if with_loads and twoshot < ALL_TOKENS else [])
                for loads_max in [twoshot] + loads:
                    yield Boundaries((*NO_LOCAL_TOKENS, oneshot, early, twoshot, loads_max), "")


def selection(root: pathlib.Path | None = None) -> Selection:
    """Boundaries for every (dtype, world size, profile): measured where a benchmark covers the
    cell (a dtype with no measurement of its own borrows the other dtype's: same bytes per element,
    same kernel; a profile with none borrows the plain profile's), the written model elsewhere and
    at world size 1 (no benchmark of it is fitted yet)."""
    root = pathlib.Path(root) if root is not None else pathlib.Path(__file__).resolve().parent.parent
    paths = bench_files(root)
    measured = measured_times(paths)
    names = ", ".join(p.relative_to(root).as_posix() for p in paths)
    boundaries = {}
    for dtype in spec.DTYPES:
        for world_size in spec.WORLD_SIZES:
            for profile in spec.OUTPUT_PROFILES:
                # Own measurements first, then the other dtype's, then the plain profile's.
                donors = [(donor_dtype, world_size, donor_profile) for donor_profile in (profile, BORROW_PROFILE)
                          for donor_dtype in (dtype, *spec.DTYPES)]
                donor = next((cell for cell in donors if cell in measured), None)
                if world_size == spec.LOCAL_WORLD_SIZE:
                    cell_boundaries = Boundaries(MODEL_WORLD_ONE, f"{MODEL_SOURCE} (nothing to exchange: local "
                                                                  f"runs every T)")
                elif donor is not None:
                    *fitted, worst, mean, over, over_at_target = fit_boundaries(measured[donor])
                    borrowed = [] if donor[0] == dtype else [f"{donor[0]} data"]
                    borrowed += [] if donor[2] == profile else [f"profile {donor[2]}"]
                    borrowed = f" ({', '.join(borrowed)})" if borrowed else ""
                    cell_boundaries = Boundaries(
                        (*NO_LOCAL_TOKENS, *fitted),
                        f"measured{borrowed}: {over} of {len(measured[donor])} points over {AUTO_TARGET_SLOWDOWN}x "
                        f"the best program ({over_at_target} at the target shape), at most {worst:.3f}x, "
                        f"mean {mean:.3f}x")
                else:
                    cell_boundaries = Boundaries((*NO_LOCAL_TOKENS, MODEL_ONESHOT_MAX_TOKENS[world_size],
                                                  MODEL_EARLY_MAX_TOKENS[world_size], ALL_TOKENS, ALL_TOKENS),
                                                 MODEL_SOURCE)
                bounds = cell_boundaries.max_tokens
                if not (0 <= bounds[0] and all(low <= high for low, high in zip(bounds, bounds[1:]))):
                    raise ValueError(f"tuning: {dtype} ws{world_size} {profile}: need 0 <= "
                                     f"{' <= '.join(spec.BOUNDARY_FIELDS)}, got {cell_boundaries}")
                boundaries[(dtype, world_size, profile)] = cell_boundaries
    return Selection(f"cells measured in {names}, the rest from the written model", boundaries)
