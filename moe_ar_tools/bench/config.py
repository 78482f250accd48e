"""The harness's settings, for every world size: the op's constants and output profiles, the
tolerances of the checks, the shape table, the option parsing, the run's options (Config) and
make_config, which checks them against a world size's vocabulary (Vocabulary: its profiles,
systems and defaults; each world's plugin declares its own)."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional


# NVLink multicast (NVLS) must never be used on the benchmark machine; set before any CUDA
# library is initialized, in the parent and in every worker.
REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_required_env() -> None:
    """REQUIRED_ENV into this process's environment."""
    os.environ.update(REQUIRED_ENV)


DEFAULT_SHAPES = "7168:8:shared,7168:8,7168:4:shared,4096:8"
DEFAULT_TOKENS = ",".join(str(2 ** i) for i in range(15))  # 1 .. 16384
# output profile -> quant argument (the exchange world sizes' profiles; world size 1 names the FP8
# group-128 scale layout too: moe_ar_tools/bench/world_one/config.py)
PROFILES = {"plain": None, "nvfp4": "nvfp4", "fp8_group128": "fp8_group128", "fp8_tensor": "fp8_tensor"}
FP8_PROFILES = ("fp8_group128", "fp8_tensor")
DTYPE_BYTES = {"bf16": 2, "fp16": 2}

# Norm-relative tolerance of residual_out and norm_out against the float64 reference, in units
# of the dtype's unit roundoff u. The fused programs round once (error about u/3); the torch
# baselines round after every op (about u); a wrong result is off by order 1.
TOLERANCE_U = 8
# Norm-relative error of NVFP4 dequant(quant_out, scale_out) against the kernel's own norm_out.
# E2M1 with a per-16 scale gives about 0.1 on Gaussian data; garbage gives about 1.
NVFP4_TOLERANCE = 0.25
# The same for FP8 E4M3 (3 mantissa bits: about 0.02 on Gaussian data).
FP8_TOLERANCE = 0.08

ROUTED_SCALING_FACTOR = 2.5  # DeepSeek-V3's
EPS = 1e-6
FALLBACK_L2_BYTES = 60 * 2 ** 20
# cold: the captured calls rotate through input sets of more than 3x the L2 (the headline at world
# size 1; timing.cold_input_sets); warm: one input set, every call (what a tail right after its GEMM
# finds at small T). World size 2+ rotates through twice the L2 (timing.input_sets_for).
L2_MODES = ("cold", "warm")
COMPILE_MODES = ("dynamic", "static")  # torch.compile of world size 1's chains: dynamic shapes, or per T


# ---- configuration parsing ---------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One row of the shape table (docs/measurement.md)."""
    hidden: int
    top_k: int
    shared: bool

    @property
    def label(self) -> str:
        return f"H{self.hidden} K{self.top_k} {'shared' if self.shared else 'no shared'}"


def parse_shapes(text: str) -> list[Shape]:
    """"7168:8:shared,4096:8" -> [Shape(7168, 8, True), Shape(4096, 8, False)]."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("shared", "noshared")):
            raise ValueError(f"shape {item!r}: expected HIDDEN:TOP_K or HIDDEN:TOP_K:shared")
        hidden, top_k = int(parts[0]), int(parts[1])
        if hidden <= 0 or hidden % 16 or not 1 <= top_k <= 16:
            raise ValueError(f"shape {item!r}: hidden must be a positive multiple of 16, top_k 1..16")
        shapes.append(Shape(hidden, top_k, len(parts) == 3 and parts[2] == "shared"))
    if not shapes:
        raise ValueError("shapes: none given")
    return shapes


def parse_tokens(text: str) -> list[int]:
    """"1,2,4" or a power-of-two range "1-16384" -> sorted distinct token counts."""
    out = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "-" in item:
            lo, hi = (int(x) for x in item.split("-"))
            tokens = lo
            while tokens <= hi:
                out.add(tokens)
                tokens *= 2
        else:
            out.add(int(item))
    if not out or min(out) < 1:
        raise ValueError(f"tokens {text!r}: need positive integers")
    return sorted(out)


def parse_list(text: str, allowed=None, what="value") -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if allowed is not None:
        for s in items:
            if s not in allowed:
                raise ValueError(f"{what} {s!r}: expected one of {', '.join(allowed)}")
    return items


# ---- the run's options --------------------------------------------------------------------------

@dataclass(frozen=True)
class Vocabulary:
    """What a world size's plugin measures: its profiles and systems (systems None: the plugin checks
    them itself, program names among them) and the defaults of --profiles, --systems, --budget-s."""
    profiles: tuple
    systems: Optional[tuple]
    default_profiles: str
    default_systems: str
    budget_s: float


@dataclass
class Config:
    """One run's options. budget_s: world size 2+ starts no token count after it (seconds from launch);
    world size 1 starts no point that would end past it (0: no budget)."""
    world: int
    shapes: list
    tokens: list
    profiles: list
    systems: list
    dtype: str = "bf16"
    reps: int = 50
    calls: int = 10
    warmup: int = 3
    out: Optional[str] = None
    seed: int = 1234
    bw_gib: float = 2.0
    budget_s: float = 0.0
    started: float = field(default_factory=time.time)
    # world size 2+
    machine: Optional[str] = None
    timeout_s: float = 30.0                 # the workspaces' peer-wait deadline
    pdl: bool = False                       # fused calls with programmatic dependent launch
    vec_per_thread: Optional[int] = None    # the workspaces' row split (None: the default)
    measure_cold_start: bool = False        # compile one program at first use, then load it warm
    cold_start_program: Optional[str] = None
    sweep: bool = True
    init_method: str = ""
    cold_start: Optional[dict] = None       # what measure_cold_start measured
    # world size 1
    compile_modes: list = field(default_factory=list)
    static_compile_shapes: list = field(default_factory=list)
    l2_modes: list = field(default_factory=list)
    flashinfer_dir: Optional[str] = None
    programs: bool = True                   # force every world-size-1 program where a cell has several

    def static_compile(self, shape: Shape) -> bool:
        return "static" in self.compile_modes and shape in self.static_compile_shapes


def make_config(vocabulary: Vocabulary, *, world: int = 2, shapes: str = DEFAULT_SHAPES, tokens: str = DEFAULT_TOKENS,
                profiles: Optional[str] = None, systems: Optional[str] = None, budget_s: Optional[float] = None,
                dtype: str = "bf16", reps: int = 50, calls: int = 10, warmup: int = 3,
                compile_modes: str = ",".join(COMPILE_MODES), static_compile_shapes: str = "7168:8:shared",
                l2: str = ",".join(L2_MODES), **rest) -> Config:
    """The options as a Config, checked against the world size's vocabulary (None: its default);
    ValueError naming the option that is wrong."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    for name, value, least in (("world", world, 1), ("reps", reps, 1), ("calls", calls, 1), ("warmup", warmup, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} {value!r}: expected an int >= {least}")
    budget_s = vocabulary.budget_s if budget_s is None else budget_s
    if not isinstance(budget_s, (int, float)) or budget_s < 0 or not math.isfinite(budget_s):
        raise ValueError(f"budget_s {budget_s!r}: expected seconds >= 0")
    return Config(world=world, shapes=parse_shapes(shapes), tokens=parse_tokens(tokens),
                  profiles=parse_list(vocabulary.default_profiles if profiles is None else profiles,
                                      vocabulary.profiles, "profile"),
                  systems=parse_list(vocabulary.default_systems if systems is None else systems,
                                     vocabulary.systems, "system"),
                  compile_modes=parse_list(compile_modes, COMPILE_MODES, "compile mode"),
                  static_compile_shapes=parse_shapes(static_compile_shapes) if static_compile_shapes else [],
                  l2_modes=parse_list(l2, L2_MODES, "L2 mode"), dtype=dtype, reps=reps, calls=calls,
                  warmup=warmup, budget_s=float(budget_s), **rest)
