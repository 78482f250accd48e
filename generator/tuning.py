"""Selection boundaries: which regime serves a token count T, per table cell.

For a call with T tokens in cell (dtype, world size, profile):

    T <= oneshot_max_tokens                       -> oneshot
    oneshot_max_tokens < T <= early_max_tokens    -> twoshot_early
    early_max_tokens < T <= twoshot_max_tokens    -> twoshot
    twoshot_max_tokens < T <= loads_max_tokens    -> twoshot_pipelined_loads
    T > loads_max_tokens                          -> twoshot_pipelined

(each then swapped for its shared-expert variant where the rank has a shared
operand and the variant's cell is not a hole).

Where the committed benchmark named by BENCH_FILE (written by `moe-ar-bench`)
measured every base program of a cell on real GPUs, the boundaries are the ones
that best fit those measurements; every cell says where its numbers came from.
Cells with no measurement (world sizes 4 and 8: no such machine here) take the
written model below. Pointing BENCH_FILE at a new benchmark is therefore a
visible table diff.
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
# with B_nvlink = 390 GB/s (measured) and H = 7168: T < 82 at W = 4, T < 23 at W = 8 (rounded
# down to a power of two). At W = 2 the bytes are equal and only measurement can decide.
# Two-shot early splits each owned row into slices; it pays while the T / W owned rows alone
# do not fill the GPU (about 2 blocks on each of 132 multiprocessors): T <= 256 * W.
# The pipelined two-shot is generated for world size 2 only (generator/policy.py); where it is not,
# the two-shot serves every T above early_max_tokens.
MODEL_ONESHOT_MAX_TOKENS = {2: 64, 4: 64, 8: 16}
MODEL_EARLY_MAX_TOKENS = {2: 512, 4: 1024, 8: 2048}
ALL_TOKENS = 2**31 - 1  # "no upper bound": the last regime a cell runs takes every larger T
MODEL_SOURCE = "written model"

# The regimes in the order they take over as T grows. Of the two pipelined two-shots, the one with
# register loads (more blocks a multiprocessor) comes first: it serves the profiles whose norm step is
# heavy while each block has few columns (spec.py, PIPELINED_LOADS); where it is a hole or slower,
# loads_max_tokens == twoshot_max_tokens and no T runs it.
BASE_FAMILIES = ("oneshot", "twoshot_early", "twoshot", "twoshot_pipelined_loads", "twoshot_pipelined")
# A profile no benchmark measured takes the plain profile's boundaries: the exchange is the same,
# only the per-row work of the last phase differs.
BORROW_PROFILE = "110"


@dataclasses.dataclass(frozen=True)
class Boundaries:
    oneshot_max_tokens: int
    early_max_tokens: int
    twoshot_max_tokens: int
    loads_max_tokens: int
    source: str

    def family(self, tokens: int) -> str:
        """The base family for T tokens (before the shared-expert variant and hole fallback)."""
        if tokens <= self.oneshot_max_tokens:
            return "oneshot"
        if tokens <= self.early_max_tokens:
            return "twoshot_early"
        if tokens <= self.twoshot_max_tokens:
            return "twoshot"
        return "twoshot_pipelined_loads" if tokens <= self.loads_max_tokens else "twoshot_pipelined"


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


def _family_of(system: str) -> str | None:
    try:
        return spec.parse(system).family
    except ValueError:
        return None  # a baseline or "auto"


def measured_times(paths) -> dict:
    """(dtype, world size, profile) -> {(hidden, top_k, shared, T): {family: median us}}, from the
    valid, non-emulated records of forced base-family programs."""
    out = collections.defaultdict(lambda: collections.defaultdict(dict))
    for path in paths:
        doc = json.loads(pathlib.Path(path).read_text())
        for r in doc.get("records", []):
            family = _family_of(r["system"])
            if family not in BASE_FAMILIES or r.get("emulated") or not r.get("valid", True):
                continue
            point = (r["hidden"], r["top_k"], bool(r["shared"]), r["tokens"])
            out[(r["dtype"], r["world_size"], r["profile"])][point][family] = r["median_us"]
    return out


# The target for the automatic choice: within 5% of the best program at every measured point.
AUTO_TARGET_SLOWDOWN = 1.05
# (hidden, top_k, shared expert) of the targets (#4: H 7168, top_k 8 with the shared expert),
# where that target is the contract. A point over the target there weighs more than any number of
# points over it at the other shapes, which are served as well as the boundaries allow: one boundary
# per cell cannot suit every shape (at eed9067 the plain one-shot was still 6% faster at 1,024 tokens
# at this shape, the pipelined two-shot 14-17% faster at 512-1,024 without the shared expert).
TARGET_SHAPE = (7168, 8, True)


def fit_boundaries(points: dict) -> tuple[int, int, int, int, float, float, int, int]:
    """The (oneshot_max_tokens, early_max_tokens, twoshot_max_tokens, loads_max_tokens) on the
    measured token grid (the last two may also be ALL_TOKENS) with the fewest measured points
    slower than AUTO_TARGET_SLOWDOWN x the best base program there, counting those at TARGET_SHAPE
    first, the mean log slowdown breaking ties; also the worst and the mean slowdown, as ratios, and
    the number of points over the target, everywhere and at TARGET_SHAPE. A rule may pick a family
    only where that family was measured at every shape it serves."""
    best = None
    for rule in _candidate_rules(points):
        slowdowns, over_at_target = [], 0
        for point, times in points.items():
            family = rule.family(point[3])
            if family not in times:
                break
            slowdowns.append(times[family] / min(times.values()))
            over_at_target += point[:3] == TARGET_SHAPE and slowdowns[-1] > AUTO_TARGET_SLOWDOWN
        else:
            over = sum(x > AUTO_TARGET_SLOWDOWN for x in slowdowns)
            mean_log = sum(math.log(x) for x in slowdowns) / max(len(slowdowns), 1)
            counts = (over_at_target, over)
            if best is None or counts < best[1][:2] or (counts == best[1][:2] and mean_log < best[1][2] - 1e-12):
                best = (rule, (over_at_target, over, mean_log), max(slowdowns, default=1.0))
    if best is None:
        raise ValueError("tuning: no set of boundaries is feasible for the measured points")
    rule, (over_at_target, over, mean_log), worst = best
    return (rule.oneshot_max_tokens, rule.early_max_tokens, rule.twoshot_max_tokens, rule.loads_max_tokens,
            worst, math.exp(mean_log), over, over_at_target)


def _candidate_rules(points: dict):
    """Every ordered set of boundaries on the measured token grid, in the order that breaks ties:
    at equal cost the first one found stays, so a tie keeps the two-shot (ALL_TOKENS first) and
    runs no T on the pipelined two-shot with register loads (loads_max_tokens == twoshot_max_tokens
    first). Where that program was not measured, only the latter."""
    candidates = [0] + sorted({p[3] for p in points})
    with_loads = any("twoshot_pipelined_loads" in times for times in points.values())
    for a in candidates:
        for b in (x for x in candidates if x >= a):
            for c in [ALL_TOKENS] + [x for x in candidates if x >= b]:
                loads = [x for x in candidates if x > c] + [ALL_TOKENS] if with_loads and c < ALL_TOKENS else []
                for d in [c] + loads:
                    yield Boundaries(a, b, c, d, "")


def selection(root: pathlib.Path | None = None) -> Selection:
    """Boundaries for every (dtype, world size, profile): measured where a benchmark covers the
    cell (a dtype with no measurement of its own borrows the other dtype's: same bytes per element,
    same kernel; a profile with none borrows the plain profile's), the written model elsewhere."""
    root = pathlib.Path(root) if root is not None else pathlib.Path(__file__).resolve().parent.parent
    paths = bench_files(root)
    measured = measured_times(paths)
    names = ", ".join(p.relative_to(root).as_posix() for p in paths)
    boundaries = {}
    for dtype in spec.DTYPES:
        for ws in spec.WORLD_SIZES:
            for profile in spec.OUTPUT_PROFILES:
                # Own measurements first, then the other dtype's, then the plain profile's.
                donors = [(d, pr) for pr in (profile, BORROW_PROFILE) for d in (dtype, *spec.DTYPES)]
                donor = next((k for k in ((d, ws, pr) for d, pr in donors) if k in measured), None)
                if donor is not None:
                    *fitted, worst, mean, over, over_at_target = fit_boundaries(measured[donor])
                    n = len(measured[donor])
                    borrowed = [] if donor[0] == dtype else [f"{donor[0]} data"]
                    borrowed += [] if donor[2] == profile else [f"profile {donor[2]}"]
                    borrowed = f" ({', '.join(borrowed)})" if borrowed else ""
                    b_ = Boundaries(*fitted, f"measured{borrowed}: {over} of {n} points over "
                                             f"{AUTO_TARGET_SLOWDOWN}x the best program ({over_at_target} at the "
                                             f"target shape), at most {worst:.3f}x, mean {mean:.3f}x")
                else:
                    b_ = Boundaries(MODEL_ONESHOT_MAX_TOKENS[ws], MODEL_EARLY_MAX_TOKENS[ws], ALL_TOKENS, ALL_TOKENS,
                                    MODEL_SOURCE)
                if not (0 <= b_.oneshot_max_tokens <= b_.early_max_tokens <= b_.twoshot_max_tokens
                        <= b_.loads_max_tokens):
                    raise ValueError(f"tuning: {dtype} ws{ws} {spec.profile_tag(profile)}: need 0 <= oneshot_max_tokens "
                                     f"<= early_max_tokens <= twoshot_max_tokens <= loads_max_tokens, got {b_}")
                boundaries[(dtype, ws, profile)] = b_
    return Selection(f"cells measured in {names}, the rest from the written model", boundaries)
