"""World size 1: the systems it times, its output profiles and vocabulary, and the plan a run
measures and compiles (--dry-run)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_ar_tools.bench import config
from moe_ar_tools.bench.config import Config, Shape, Vocabulary

# triton_fused: the whole tail in one Triton launch; chain: a Triton gather-sum kernel, then FlashInfer's
# add + RMSNorm where it runs, else a Triton one (moe_ar_tools/baselines/triton_fused.py)
# ours_pdl: ours launched with programmatic dependent launch, as engines launch it (the baselines
# launch without: context beside ours, not what the targets compare)
SYSTEMS = ("ours", "ours_pdl", "triton_fused", "chain", "torch_eager", "torch_compile", "flashinfer")
BASELINES = SYSTEMS[2:]
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

VOCABULARY = Vocabulary(profiles=tuple(PROFILES), systems=SYSTEMS, default_profiles=",".join(PROFILES),
                        default_systems=",".join(SYSTEMS), budget_s=480.0)


def make_config(**options) -> Config:
    """The options of a world-size-1 run as a Config (moe_ar_tools.bench.config.make_config)."""
    return config.make_config(VOCABULARY, world=1, **options)


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
