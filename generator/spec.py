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
# Output profiles: what is written besides norm_out and residual_out (input dtype). The numeric
# codes flag which of norm_out, residual_out, quant_out are written (docs/operation.md); later
# profiles are named.
#   110:          nothing more
#   111:          NVFP4 quant_out (packed E2M1) + swizzled 128x4 E4M3 scale_out
#   fp8_group128: FP8 E4M3 quant_out + float32 scale per 128-element group of a token
#   fp8_tensor:   FP8 E4M3 quant_out with one per-tensor scale read from the device
OUTPUT_PROFILES = ("110", "111", "fp8_group128", "fp8_tensor")
OUTPUT_PROFILE_MEANING = {
    "110": "norm_out + residual_out (input dtype)",
    "111": "norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)",
    "fp8_group128": "norm_out + residual_out + FP8 E4M3 quant_out + float32 scale_out per 128-element token group "
                    "(row- or column-major, optionally power-of-two)",
    "fp8_tensor": "norm_out + residual_out + FP8 E4M3 quant_out with a per-tensor scale given on the device",
}
# The value of the call's `quant=` argument that asks for each profile.
PROFILE_QUANT = {"110": None, "111": "nvfp4", "fp8_group128": "fp8_group128", "fp8_tensor": "fp8_tensor"}
# Families: the token regime plus how the shared-expert row is loaded.
FAMILIES = ("oneshot", "twoshot", "twoshot_early", "twoshot_shared", "twoshot_early_shared", "twoshot_pipelined",
            "twoshot_pipelined_loads")
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
    "twoshot_pipelined": "two-shot with its phases pipelined over token columns, so one column's reads overlap the exchange of the columns before; no self-traffic through its own buffer, every received vector cleared as it is read; the partials' rows come through a ring in shared memory (largest T; world size 2)",
    "twoshot_pipelined_loads": "twoshot_pipelined with the partials' rows loaded into registers instead of the ring: more blocks a multiprocessor, for the profiles whose norm step is heavy, below the T where the ring takes over (world size 2)",
}
# The base family each variant falls back to when its cell is a hole.
BASE_FAMILY = {
    "oneshot": "oneshot",
    "twoshot": "twoshot",
    "twoshot_early": "twoshot",
    "twoshot_shared": "twoshot",
    "twoshot_early_shared": "twoshot_early",
    "twoshot_pipelined": "twoshot",
    "twoshot_pipelined_loads": "twoshot_pipelined",
}
# Programs of one protocol class run the same exchange (same buffers, same
# Lamport sequence); ranks may mix programs of one class in one call.
PROTOCOL = {
    "oneshot": "lamport1",
    "twoshot": "lamport2",
    "twoshot_early": "lamport2",
    "twoshot_shared": "lamport2",
    "twoshot_early_shared": "lamport2",
    "twoshot_pipelined": "lamport2",
    "twoshot_pipelined_loads": "lamport2",
}

FAMILY_SHORT = {
    "oneshot": "os",
    "twoshot": "ts",
    "twoshot_early": "tse",
    "twoshot_shared": "tss",
    "twoshot_early_shared": "tses",
    "twoshot_pipelined": "tsp",
    "twoshot_pipelined_loads": "tspl",
}
# C++ spelling of each family: the table generated/tables/<family>.h declares
# k<FAMILY_CAMEL>Kernels.
FAMILY_CAMEL = {
    "oneshot": "OneShot",
    "twoshot": "TwoShot",
    "twoshot_early": "TwoShotEarly",
    "twoshot_shared": "TwoShotShared",
    "twoshot_early_shared": "TwoShotEarlyShared",
    "twoshot_pipelined": "TwoShotPipelined",
    "twoshot_pipelined_loads": "TwoShotPipelinedLoads",
}

# How each axis value reaches the C++ body (templates/moe_finalize_allreduce.cuh.j2).
DTYPE_CPP = {"fp16": "__half", "bf16": "__nv_bfloat16"}
PROFILE_CPP = {"110": "moe_ar::Profile::kPlain", "111": "moe_ar::Profile::kNvfp4",
               "fp8_group128": "moe_ar::Profile::kFp8Group128", "fp8_tensor": "moe_ar::Profile::kFp8Tensor"}
# Outputs each profile writes, besides norm_out and residual_out.
PROFILE_EXTRA_OUTPUTS = {"110": (), "111": ("quant_out", "scale_out"), "fp8_group128": ("quant_out", "scale_out"),
                         "fp8_tensor": ("quant_out",)}
# Each family is a token regime plus whether it prefetches the shared-expert row. The manifest
# carries both, so the runtime never reads them out of family names.
FAMILY_REGIME = {
    "oneshot": ("oneshot", False),
    "twoshot": ("twoshot", False),
    "twoshot_early": ("twoshot_early", False),
    "twoshot_shared": ("twoshot", True),
    "twoshot_early_shared": ("twoshot_early", True),
    "twoshot_pipelined": ("twoshot_pipelined", False),
    "twoshot_pipelined_loads": ("twoshot_pipelined_loads", False),
}
# The two pipelined regimes are one kernel regime; they differ in how the rows arrive (row_stages).
REGIME_CPP = {"oneshot": "moe_ar::Regime::kOneShot", "twoshot": "moe_ar::Regime::kTwoShot",
              "twoshot_early": "moe_ar::Regime::kTwoShotEarly", "twoshot_pipelined": "moe_ar::Regime::kTwoShotPipelined",
              "twoshot_pipelined_loads": "moe_ar::Regime::kTwoShotPipelined"}
# Register caps, per (regime, world size); absent: None, compiled with __launch_bounds__(MAX_THREADS)
# and ptxas chooses. A cap compiles with __maxnreg__(cap). 72 keeps four 224-thread blocks (H 7168)
# on a multiprocessor. Measured on 2x H200 (bench_results/registers/): from 1,024 tokens up the
# world-size-2 two-shot programs gain 5-16% with the cap (NVFP4 and FP8-group the most; the plain
# early two-shot, already at 64 registers, neither gains nor loses), though they spill 36-204 bytes;
# the one-shot programs, which serve the small-T latency range, lose 5-20% and stay uncapped.
# World sizes 4 and 8 have no hardware to measure on and keep ptxas's choice (capped, they would
# spill 116-560 bytes). The pipelined two-shot (world size 2 only) with register loads measured
# fastest at 72 too: at 8,192 tokens 557 us against 611 at a cap of 80 and 749 uncapped (127
# registers), though it spills 64-124 bytes (bench_results/pipelined/); with the row ring it has
# its own cap (below).
REGISTER_CAP = {("twoshot", 2): 72, ("twoshot_early", 2): 72, ("twoshot_pipelined_loads", 2): 72}

# The pipelined two-shot's partials, two ways (two families, one kernel regime):
#   twoshot_pipelined: their rows come through a ring of PIPELINED_ROW_STAGES rows in shared
#     memory, filled by bulk copies (the template's RowRing). Its dynamic shared memory is stages x
#     H x the dtype's bytes + 128 (the barriers). A block holds no loads in flight in registers, so it
#     compiles under PIPELINED_RING_CAP: two 224-thread blocks a multiprocessor (H 7168), no spills.
#   twoshot_pipelined_loads: 16-byte register loads, PIPELINED_LOADS at a time, under the cap of 72
#     (four blocks a multiprocessor), for the profiles listed there; a hole for the others
#     (policy.py), where the ring was faster at every measured T.
# Same-run A/Bs on 2x H200, H 7168 top_k 8 + shared, 1,024 (NVFP4: 512) to 16,384 tokens, ring
# against the register loads (bench_results/pipelined/row_ring/): plain 2-9% faster, FP8-tensor 3-8%, FP8-group
# 4.5% slower at 1,024, 0.7% at 2,048 and 1.5-7% faster from 4,096; NVFP4, whose norm step is the
# heaviest, 3-5.5% slower at 512-1,024 tokens, 0.7% at 2,048-4,096, 0.7% faster at 8,192 and 3.5% at
# 16,384 (with the fewest-instructions E2M1 coding, which the ring's registers allow). Fewer blocks
# with more columns each suit the ring at large T; more blocks hide the heavy norm step better at
# few columns a block. The selection table (tuning.py) says which serves which T, per cell. Three rows
# and two blocks were the fastest ring: five rows up to 5% slower from 4,096 tokens, three blocks (cap
# 96) up to 4% slower (NVFP4 2-9%), four (cap 72, spilling) 4-19% slower, one block 30-90% slower.
PIPELINED_ROW_STAGES = 3
PIPELINED_RING_CAP = 128
PIPELINED_LOADS = {"111": (4, True), "fp8_group128": (4, True)}

# The one-shot, every profile: four routes, the shared row first. Same registers as the shared row
# last (61-64), 2-4.5% faster from 16 to 128 tokens (128: 16.3 -> 15.8 us plain), unchanged at
# 1,024; eight routes (80-85 registers, one block of 448 threads a multiprocessor) were 5-7% faster
# at 128 tokens but 6-27% slower from 256, and under a cap of 72 slower everywhere (2x H200, H 7168
# top_k 8 + shared, bench_results/oneshot/loads/).
ONESHOT_LOADS = (4, True)


def row_stages(family: str, profile: str) -> int:
    """Rows in the shared-memory ring of a program's partials; 0: it loads them into registers."""
    return PIPELINED_ROW_STAGES if FAMILY_REGIME[family][0] == "twoshot_pipelined" else 0


def loads_in_flight(family: str, profile: str) -> tuple[int, bool] | None:
    """(routes at a time, shared row first) of partial_vector, for a one-shot program or a pipelined
    two-shot with register loads; None for the others, which load four routes at a time, the shared
    row last (also the pipelined two-shots' fault-injection path, the two-shot's)."""
    regime = FAMILY_REGIME[family][0]
    if regime == "oneshot":
        return ONESHOT_LOADS
    if regime == "twoshot_pipelined_loads":
        return PIPELINED_LOADS[profile]
    return None


def register_cap(family: str, world_size: int, profile: str) -> int | None:
    if row_stages(family, profile):
        return PIPELINED_RING_CAP
    return REGISTER_CAP.get((FAMILY_REGIME[family][0], world_size))


# Regimes whose exchange phases split a row into blockDim-wide slices (one work unit per slice).
SLICED_REGIMES = ("oneshot", "twoshot_early")
# Regimes whose work unit is a column: token j of each rank (the pipelined two-shots).
COLUMN_REGIMES = ("twoshot_pipelined", "twoshot_pipelined_loads")

PREFIX = "moe_ar"


def profile_tag(profile: str) -> str:
    """How a profile appears in names: o110, o111 (docs/operation.md's codes), fp8_group128, fp8_tensor."""
    return f"o{profile}" if profile.isdigit() else profile


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
        """e.g. moe_ar_tss_bf16_ws4_o111, moe_ar_os_bf16_ws2_fp8_group128; also the kernel symbol."""
        return f"{PREFIX}_{FAMILY_SHORT[self.family]}_{self.dtype}_ws{self.world_size}_{profile_tag(self.profile)}"

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
_TAG_TO_PROFILE = {profile_tag(p): p for p in OUTPUT_PROFILES}
_NAME_RE = re.compile(rf"^{PREFIX}_([a-z]+)_([a-z0-9]+)_ws(\d+)_([a-z0-9_]+)$")


def parse(name: str) -> ProgramSpec:
    m = _NAME_RE.match(name)
    if not m or m.group(1) not in _SHORT_TO_FAMILY or m.group(4) not in _TAG_TO_PROFILE:
        raise ValueError(f"name: {name!r} is not a program name like {PREFIX}_ts_bf16_ws2_o110")
    return ProgramSpec(_SHORT_TO_FAMILY[m.group(1)], m.group(2), int(m.group(3)), _TAG_TO_PROFILE[m.group(4)])


def all_cells():
    """Every (family, dtype, world_size, profile) in fixed table order."""
    for family, dtype, ws, prof in itertools.product(FAMILIES, DTYPES, WORLD_SIZES, OUTPUT_PROFILES):
        yield ProgramSpec(family, dtype, ws, prof)
