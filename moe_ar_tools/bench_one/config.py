"""The world-size-1 benchmark's settings: the systems it times, the output profiles, the run's options
(Config, make_config) and the plan a run measures and compiles (--dry-run)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from moe_ar_tools.bench.config import (DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPE_BYTES, Shape, parse_list, parse_shapes,
                                       parse_tokens)

# triton_fused: the whole tail in one Triton launch; chain: a Triton gather-sum kernel, then FlashInfer's
# add + RMSNorm where it runs, else a Triton one (moe_ar_tools/baselines/triton_fused.py)
# ours_pdl: ours launched with programmatic dependent launch, as engines launch it (the baselines
# launch without: context beside ours, not what the targets compare)
SYSTEMS = ("ours", "ours_pdl", "triton_fused", "chain", "torch_eager", "torch_compile", "flashinfer")
BASELINES = SYSTEMS[2:]
COMPILE_MODES = ("dynamic", "static")
# cold: the captured calls rotate through input sets of more than 3x the L2 (the headline;
# moe_ar_tools.bench.timing.cold_input_sets); warm: one input set, every call (what a tail right
# after its GEMM finds at small T)
L2_MODES = ("cold", "warm")
# a record's system: one of SYSTEMS, a forced program ("program", its name the variant), the floor's empty kernel
RECORD_SYSTEMS = SYSTEMS + ("program", "empty_kernel")
TARGET_SHAPE = Shape(7168, 8, True)


@dataclass(frozen=True)
class Profile:
    """An output profile: dispatch's quant= and fp8_scale_layout=, and moe_ar_tools.bench's profile name
    for the byte count."""
    name: str
    quant: Optional[str]
    scale_layout: Optional[str]
    bench_profile: str


PROFILES = {p.name: p for p in (
    Profile("plain", None, None, "plain"),
    Profile("nvfp4", "nvfp4", None, "nvfp4"),
    Profile("fp8_group128_row", "fp8_group128", "row", "fp8_group128"),
    Profile("fp8_group128_col", "fp8_group128", "column", "fp8_group128"),
    Profile("fp8_tensor", "fp8_tensor", None, "fp8_tensor"),
)}

DEFAULT_BUDGET_S = 480.0


# ---- options -----------------------------------------------------------------------------------

@dataclass
class Config:
    shapes: list
    tokens: list
    profiles: list
    systems: list
    compile_modes: list
    static_compile_shapes: list
    dtype: str = "bf16"
    reps: int = 50
    calls: int = 10
    warmup: int = 3
    budget_s: float = DEFAULT_BUDGET_S   # 0: none
    out: Optional[str] = None
    seed: int = 1234
    bw_gib: float = 2.0
    flashinfer_dir: Optional[str] = None
    programs: bool = True                 # force every world-size-1 program where a cell has several
    l2_modes: list = field(default_factory=lambda: list(L2_MODES))
    started: float = field(default_factory=time.time)

    def static_compile(self, shape: Shape) -> bool:
        return "static" in self.compile_modes and shape in self.static_compile_shapes


def make_config(*, shapes=DEFAULT_SHAPES, tokens=DEFAULT_TOKENS, profiles=",".join(PROFILES),
                systems=",".join(SYSTEMS), compile_modes=",".join(COMPILE_MODES),
                static_compile_shapes="7168:8:shared", dtype="bf16", reps=50, calls=10, warmup=3,
                budget_s=DEFAULT_BUDGET_S, l2=",".join(L2_MODES), **rest) -> Config:
    """The options as a Config; ValueError naming the option that is wrong."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    for name, value, least in (("reps", reps, 1), ("calls", calls, 1), ("warmup", warmup, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} {value!r}: expected an int >= {least}")
    if not isinstance(budget_s, (int, float)) or budget_s < 0 or not math.isfinite(budget_s):
        raise ValueError(f"budget_s {budget_s!r}: expected seconds >= 0 (0: no budget)")
    return Config(shapes=parse_shapes(shapes), tokens=parse_tokens(tokens),
                  profiles=parse_list(profiles, tuple(PROFILES), "profile"),
                  systems=parse_list(systems, SYSTEMS, "system"),
                  compile_modes=parse_list(compile_modes, COMPILE_MODES, "compile mode"),
                  static_compile_shapes=parse_shapes(static_compile_shapes) if static_compile_shapes else [],
                  dtype=dtype, reps=reps, calls=calls, warmup=warmup, budget_s=float(budget_s),
                  l2_modes=parse_list(l2, L2_MODES, "L2 mode"), **rest)


def plan(cfg: Config) -> dict:
    """What a run measures and compiles (the --dry-run output)."""
    points = len(cfg.shapes) * len(cfg.tokens) * len(cfg.profiles) * len(cfg.l2_modes)
    compiles = {"dynamic": 0, "static": 0}
    if "torch_compile" in cfg.systems or "flashinfer" in cfg.systems:
        if "dynamic" in cfg.compile_modes:
            # one graph per profile and shared-expert presence, a second one where T = 1 (size-1 specialization)
            variants = {(p, s.shared, t == 1) for s in cfg.shapes for p in cfg.profiles for t in cfg.tokens}
            compiles["dynamic"] = len(variants) * ("torch_compile" in cfg.systems) + \
                len({(s.shared, t == 1) for s in cfg.shapes for t in cfg.tokens}) * ("flashinfer" in cfg.systems)
        static_shapes = [s for s in cfg.shapes if cfg.static_compile(s)]
        compiles["static"] = len(static_shapes) * len(cfg.tokens) * \
            (len(cfg.profiles) * ("torch_compile" in cfg.systems) + ("flashinfer" in cfg.systems))
    return {"points": points, "shapes": [s.label for s in cfg.shapes], "tokens": cfg.tokens, "profiles": cfg.profiles,
            "systems": cfg.systems, "compile_modes": cfg.compile_modes, "l2_modes": cfg.l2_modes,
            "static_compile_shapes": [s.label for s in cfg.static_compile_shapes], "compiles": compiles,
            "reps": cfg.reps, "calls": cfg.calls, "budget_s": cfg.budget_s}
