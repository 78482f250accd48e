"""The space of programs: axes, the frozen spec of one program, names.

Every name a program has (program name, kernel symbol, file name, cache name)
is derived from its ProgramSpec, and `parse(name)` gives the spec back.
Adding a value to an axis is a change to the tuples below (and, for a new
output profile, to the template where its math lives); nothing else.
"""
from __future__ import annotations

import dataclasses
import itertools
import re

# ---- the axes, in table-index order -------------------------------------------------

DTYPES = ("fp16", "bf16")
WORLD_SIZES = (2, 4, 8)
# Output profile codes: which of (norm_out, residual_out, quant_out) are written.
#   110: norm_out + residual_out in the input dtype
#   111: also NVFP4 quant_out (packed E2M1) + swizzled 128x4 E4M3 scale_out
OUTPUT_PROFILES = ("110", "111")
OUTPUT_PROFILE_MEANING = {
    "110": "norm_out + residual_out (input dtype)",
    "111": "norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)",
}
# Families: the token regime plus how the shared-expert row is loaded.
FAMILIES = ("oneshot", "twoshot", "twoshot_early", "twoshot_shared", "twoshot_early_shared")
# Compile targets: every program compiles for each of these.
ARCH_TARGETS = ("sm_90a", "sm_100a")
# NVRTC options every program is compiled with (besides --gpu-architecture and
# -I<CUDA headers>); the manifest carries them so the runtime compiles alike.
# IEEE fp32 (denormals kept, correctly rounded division): the NVFP4 rule depends on it.
COMPILE_OPTIONS = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "--fmad=true")

FAMILY_MEANING = {
    "oneshot": "Lamport one-shot: every rank sends its partial to every peer and reduces all tokens itself (small T)",
    "twoshot": "Lamport two-shot: reduce-scatter to the token's owner, owner adds residual, all-gather residual_out; one block per token row in every phase (large T)",
    "twoshot_early": "two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill the GPU (lower two-shot range)",
    "twoshot_shared": "twoshot + shared-expert row prefetched into L2 before the exchange and loaded read-only",
    "twoshot_early_shared": "twoshot_early + shared-expert row prefetched into L2 before the exchange and loaded read-only",
}
# The base family each variant falls back to when its cell is a hole.
BASE_FAMILY = {
    "oneshot": "oneshot",
    "twoshot": "twoshot",
    "twoshot_early": "twoshot",
    "twoshot_shared": "twoshot",
    "twoshot_early_shared": "twoshot_early",
}
# Programs of one protocol class run the same exchange (same buffers, same
# Lamport sequence); ranks may mix programs of one class in one call.
PROTOCOL = {
    "oneshot": "lamport1",
    "twoshot": "lamport2",
    "twoshot_early": "lamport2",
    "twoshot_shared": "lamport2",
    "twoshot_early_shared": "lamport2",
}

FAMILY_SHORT = {
    "oneshot": "os",
    "twoshot": "ts",
    "twoshot_early": "tse",
    "twoshot_shared": "tss",
    "twoshot_early_shared": "tses",
}
# C++ spelling of each family: the table generated/tables/<family>.h declares
# k<FAMILY_CAMEL>Kernels.
FAMILY_CAMEL = {
    "oneshot": "OneShot",
    "twoshot": "TwoShot",
    "twoshot_early": "TwoShotEarly",
    "twoshot_shared": "TwoShotShared",
    "twoshot_early_shared": "TwoShotEarlyShared",
}

# How each axis value reaches the C++ body (templates/moe_finalize_allreduce.cuh.j2).
DTYPE_CPP = {"fp16": "__half", "bf16": "__nv_bfloat16"}
PROFILE_CPP = {"110": "moe_ar::Profile::kPlain", "111": "moe_ar::Profile::kNvfp4"}
# Outputs each profile writes, besides norm_out and residual_out.
PROFILE_EXTRA_OUTPUTS = {"110": (), "111": ("quant_out", "scale_out")}
FAMILY_CPP = {  # (regime, shared-expert prefetch)
    "oneshot": ("moe_ar::Regime::kOneShot", "false"),
    "twoshot": ("moe_ar::Regime::kTwoShot", "false"),
    "twoshot_early": ("moe_ar::Regime::kTwoShotEarly", "false"),
    "twoshot_shared": ("moe_ar::Regime::kTwoShot", "true"),
    "twoshot_early_shared": ("moe_ar::Regime::kTwoShotEarly", "true"),
}

PREFIX = "moe_ar"


@dataclasses.dataclass(frozen=True, order=True)
class ProgramSpec:
    family: str
    dtype: str
    world_size: int
    profile: str

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: unknown {self.family!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}")
        if self.world_size not in WORLD_SIZES:
            raise ValueError(f"world_size: unknown {self.world_size!r}")
        if self.profile not in OUTPUT_PROFILES:
            raise ValueError(f"profile: unknown {self.profile!r}")

    @property
    def name(self) -> str:
        """e.g. moe_ar_tss_bf16_ws4_o111; also the kernel symbol."""
        return f"{PREFIX}_{FAMILY_SHORT[self.family]}_{self.dtype}_ws{self.world_size}_o{self.profile}"

    @property
    def symbol(self) -> str:
        return self.name

    @property
    def file_name(self) -> str:
        return f"programs/{self.name}.cu"

    @property
    def cache_name(self) -> str:
        return f"{self.name}.cubin"

    @property
    def protocol_class(self) -> str:
        return f"{PROTOCOL[self.family]}_{self.dtype}_ws{self.world_size}"

    @property
    def base_family(self) -> str:
        return BASE_FAMILY[self.family]


_SHORT_TO_FAMILY = {v: k for k, v in FAMILY_SHORT.items()}
_NAME_RE = re.compile(rf"^{PREFIX}_([a-z]+)_([a-z0-9]+)_ws(\d+)_o(\d+)$")


def parse(name: str) -> ProgramSpec:
    m = _NAME_RE.match(name)
    if not m or m.group(1) not in _SHORT_TO_FAMILY:
        raise ValueError(f"name: {name!r} is not a program name like {PREFIX}_ts_bf16_ws2_o110")
    return ProgramSpec(_SHORT_TO_FAMILY[m.group(1)], m.group(2), int(m.group(3)), m.group(4))


def all_cells():
    """Every (family, dtype, world_size, profile) in fixed table order."""
    for family, dtype, ws, prof in itertools.product(FAMILIES, DTYPES, WORLD_SIZES, OUTPUT_PROFILES):
        yield ProgramSpec(family, dtype, ws, prof)
