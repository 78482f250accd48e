"""Selection boundaries: which regime serves a token count T, per table cell.

For a call with T tokens in cell (dtype, world size, profile):

    T <= oneshot_max_tokens                       -> oneshot
    oneshot_max_tokens < T <= early_max_tokens    -> twoshot_early
    T > early_max_tokens                          -> twoshot

(each then swapped for its shared-expert variant where the rank has a shared
operand and the variant's cell is not a hole).

The numbers below come from a written model of the exchange (bytes moved per
rank vs. blocks that fill the GPU), not from measurements: `source` says so.
`selection()` is the one function a later step replaces to read committed
results from bench_results/.
"""
from __future__ import annotations

import dataclasses

from . import spec

SOURCE = "model"

# world size -> largest T served by one-shot. One-shot moves (W-1)*T*H elements
# per rank, two-shot about 2*T*H*(W-1)/W, so one-shot wins only while latency,
# not bandwidth, dominates; the break-even T shrinks as W grows.
ONESHOT_MAX_TOKENS = {2: 64, 4: 32, 8: 16}
# world size -> largest T served by two-shot early (row slices keep the GPU full
# while each rank owns few tokens: T / W rows).
EARLY_MAX_TOKENS = {2: 512, 4: 512, 8: 1024}


@dataclasses.dataclass(frozen=True)
class Boundaries:
    oneshot_max_tokens: int
    early_max_tokens: int


@dataclasses.dataclass(frozen=True)
class Selection:
    source: str  # "model", or later where the measurements came from
    # (dtype, world_size, profile) -> Boundaries, for every cell of the table
    boundaries: dict


def selection() -> Selection:
    """Boundaries for every (dtype, world size, profile), from the tables above."""
    boundaries = {}
    for dtype in spec.DTYPES:
        for ws in spec.WORLD_SIZES:
            for profile in spec.OUTPUT_PROFILES:
                b = Boundaries(ONESHOT_MAX_TOKENS[ws], EARLY_MAX_TOKENS[ws])
                if not 0 <= b.oneshot_max_tokens <= b.early_max_tokens:
                    raise ValueError(f"tuning: {dtype} ws{ws} o{profile}: need 0 <= oneshot_max_tokens "
                                     f"<= early_max_tokens, got {b}")
                boundaries[(dtype, ws, profile)] = b
    return Selection(SOURCE, boundaries)
