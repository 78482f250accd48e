"""The benchmark's settings: the systems it times, the output profiles, the tolerances of its
checks, the op's constants, the shape table and the run's options (Config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


# NVLink multicast (NVLS) must never be used on the benchmark machine; set before any CUDA
# library is initialized, in the parent and in every worker.
REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

DEFAULT_SHAPES = "7168:8:shared,7168:8,7168:4:shared,4096:8"
DEFAULT_TOKENS = ",".join(str(2 ** i) for i in range(15))  # 1 .. 16384
DEFAULT_SYSTEMS = "nccl+torch,symm+torch,nccl+compiled,symm+compiled,auto,auto+quant,programs"
# the unfused finalize + all-reduce + epilogue steps; "best baseline" is the fastest of these
UNFUSED_BASELINES = ("nccl+torch", "symm+torch", "nccl+compiled", "symm+compiled")
BASELINES = UNFUSED_BASELINES + ("auto+quant",)
SYSTEM_CHOICES = ("auto", "nccl+torch", "symm+torch", "nccl+compiled", "symm+compiled", "auto+quant", "programs")
COMPILED_SYSTEMS = ("nccl+compiled", "symm+compiled")
# output profile -> quant argument
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

@dataclass
class Config:
    world: int
    shapes: list
    tokens: list
    profiles: list
    dtype: str
    systems: list
    reps: int
    calls: int
    warmup: int
    out: Optional[str]
    machine: Optional[str]
    timeout_s: float
    seed: int
    bw_gib: float
    time_budget_s: float
    started: float
    init_method: str = ""
    cold_start: Optional[dict] = None
    pdl: bool = False                       # fused calls with programmatic dependent launch
    vec_per_thread: Optional[int] = None    # the workspaces' row split (None: the default)
