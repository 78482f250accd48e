"""What each call of the soak does, in pure Python: the regime boundaries of the selection table,
the token sampler, the token counts graphs are captured at, and each call's random options."""
from __future__ import annotations

import math
import random
from typing import NamedTuple, Optional

from moe_ar_tools import reference as ref


DROP_FRAC = 0.2  # the share of routes dropped in a call that drops routes
# (probability) log-uniform, near a regime boundary, special value, uniform
DEFAULT_MIX = (0.45, 0.30, 0.10, 0.15)
GS_LOG_RANGES = {  # natural-log ranges of the NVFP4 global scale (norm_out is O(1): typical is ~2688/amax)
    "typical": (math.log(150.0), math.log(1500.0)),
    "small": (math.log(1e-3), math.log(1.0)),     # zero and subnormal E4M3 block scales
    "large": (math.log(1e4), math.log(1e6)),      # block scales saturating at 448
}


def regime_boundaries(select, max_tokens: int, quants, shared_options=(False, True)) -> dict:
    """quant -> sorted token counts T (2..max_tokens) where select(T, quant, shared) differs from
    select(T - 1, quant, shared) for some shared option: the first T of each new regime."""
    out = {}
    for quant in quants:
        bounds = set()
        for shared in shared_options:
            prev = select(1, quant, shared)
            for T in range(2, max_tokens + 1):
                cur = select(T, quant, shared)
                if cur != prev:
                    bounds.add(T)
                prev = cur
        out[quant] = sorted(bounds)
    return out


def regime_ranges(bounds, max_tokens: int) -> list:
    """[(lo, hi)] inclusive token ranges of the regimes between the boundaries."""
    edges = [1] + [b for b in sorted(bounds) if 1 < b <= max_tokens] + [max_tokens + 1]
    return [(lo, hi - 1) for lo, hi in zip(edges, edges[1:]) if lo <= hi - 1]


class TokenSampler:
    """T for a call: log-uniform over 1..max_tokens, near a regime boundary (b - 3 .. b + 2), a special
    value (1, W - 1, W, W + 1, max_tokens, ...), or uniform; `mix` gives the four probabilities."""

    def __init__(self, max_tokens: int, boundaries: dict, world_size: int, rnd: random.Random,
                 mix=DEFAULT_MIX):
        if max_tokens < 1:
            raise ValueError(f"max_tokens: {max_tokens}")
        self.max_tokens = max_tokens
        self.boundaries = {q: sorted(b) for q, b in boundaries.items()}
        self.specials = sorted({t for t in (1, 2, world_size - 1, world_size, world_size + 1, max_tokens - 1,
                                            max_tokens) if 1 <= t <= max_tokens})
        self.rnd = rnd
        total = float(sum(mix))
        acc, self.cum = 0.0, []  # cumulative probabilities of the four kinds of draw
        for share in mix:
            acc += share / total
            self.cum.append(acc)
        self.log_max = math.log(max_tokens + 1)

    def draw(self, quant=None) -> int:
        rnd = self.rnd
        kind = rnd.random()
        bounds = self.boundaries.get(quant) or []
        if kind < self.cum[0]:
            T = int(math.exp(rnd.random() * self.log_max))
        elif kind < self.cum[1] and bounds:
            T = rnd.choice(bounds) + rnd.randint(-3, 2)
        elif kind < self.cum[2]:
            T = rnd.choice(self.specials)
        else:
            T = rnd.randint(1, self.max_tokens)
        return min(max(T, 1), self.max_tokens)


def graph_token_counts(bounds, max_tokens: int, rnd: random.Random) -> list:
    """Token counts to capture graphs at: each regime's first and last T and one inside it."""
    out = set()
    for lo, hi in regime_ranges(bounds, max_tokens):
        out.update((lo, hi, rnd.randint(lo, hi)))
    return sorted(out)


class CallConfig(NamedTuple):
    tokens: int
    top_k: int
    padded_rows: int
    drop: bool            # some routes dropped (index -1)
    scale: str            # expert_scale_factor: "none", "fp32", "dtype"
    shared: str           # shared_expert_output: "none", "all" ranks, "rank0" only
    quant: Optional[str]  # None or "nvfp4"
    pdl: bool
    rsf: float
    weight_bias: int
    eps: float
    std: float            # standard deviation of allreduce_in (and half of it for the shared expert)
    gs_range: str         # key of GS_LOG_RANGES


def draw_config(rnd: random.Random, quant, tokens: int, max_rows: int) -> CallConfig:
    """Random options for one call of `tokens` tokens; allreduce_in rows (T*K + padding) stay <= max_rows."""
    K = rnd.randint(1, 8)
    if rnd.random() < 0.05 and tokens * 16 + 16 <= max_rows:
        K = rnd.randint(9, 16)
    K = max(1, min(K, max_rows // tokens))
    pad = 0 if rnd.random() < 0.7 else rnd.randint(1, 16)
    pad = max(0, min(pad, max_rows - tokens * K))
    return CallConfig(
        tokens=tokens, top_k=K, padded_rows=pad, drop=rnd.random() < 0.25,
        scale=rnd.choice(("none", "fp32", "dtype")), shared=rnd.choice(("none", "all", "rank0")), quant=quant,
        pdl=rnd.random() < 0.5, rsf=1.0 if rnd.random() < 0.5 else ref.f32(rnd.uniform(0.5, 2.0)),
        weight_bias=rnd.randint(0, 1), eps=rnd.choice((1e-6, 1e-5)),
        std=rnd.choice((1.0, 1.0, 1.0, 1.0, 1.0, 0.05, 8.0)),
        gs_range=rnd.choice(("typical",) * 6 + ("small", "large")))


def default_max_tokens(bounds: list) -> int:
    """max(2048, last boundary + 255) rounded up to a multiple of 128, so that every regime of every
    profile of the workspace's selection (`bounds`: {ladder field: tokens} per profile,
    dispatch.table_sets.Selection.limits) is reachable."""
    from dispatch import registry
    last = max([1] + [int(value) + 1 for row in bounds for value in row.values()
                      if int(value) < registry.program_set().all_tokens])
    need = last + 255
    return max(2048, -(-need // 128) * 128)
