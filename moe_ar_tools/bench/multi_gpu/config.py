"""World size 2 and up: the systems it times and its vocabulary (profiles, systems, defaults), and
the plan of a run (--dry-run)."""
from __future__ import annotations

from moe_ar_tools.bench.config import PROFILES, Config, Vocabulary

DEFAULT_SYSTEMS = "nccl+torch,symm+torch,nccl+compiled,symm+compiled,auto,auto+quant,programs"
# the unfused finalize + all-reduce + epilogue steps; "best baseline" is the fastest of these
UNFUSED_BASELINES = ("nccl+torch", "symm+torch", "nccl+compiled", "symm+compiled")
BASELINES = UNFUSED_BASELINES + ("auto+quant",)
SYSTEM_CHOICES = ("auto", "nccl+torch", "symm+torch", "nccl+compiled", "symm+compiled", "auto+quant", "programs")
COMPILED_SYSTEMS = ("nccl+compiled", "symm+compiled")

# systems None: besides SYSTEM_CHOICES any program's name (checked against dispatch.programs())
VOCABULARY = Vocabulary(profiles=tuple(PROFILES), systems=None, default_profiles="plain,nvfp4",
                        default_systems=DEFAULT_SYSTEMS, budget_s=420.0)


def plan(cfg: Config) -> dict:
    """What a run measures (the --dry-run output)."""
    return {"world_size": cfg.world, "points": len(cfg.shapes) * len(cfg.tokens) * len(cfg.profiles),
            "shapes": [s.label for s in cfg.shapes], "tokens": cfg.tokens, "profiles": cfg.profiles,
            "systems": cfg.systems, "reps": cfg.reps, "calls": cfg.calls, "budget_s": cfg.budget_s,
            "cold_start": cfg.measure_cold_start, "sweep": cfg.sweep}
