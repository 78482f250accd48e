"""The space of programs: one record per family, output profile and token regime; the frozen
spec of one program; its names.

Every table of the generator, the manifest and (through the manifest) the runtime derives from
the records below. Every name a program has (program name = kernel symbol, file name) is derived
from its ProgramSpec, spelling its family, dtype, world size and profile by their names, and
`parse(name)` gives the spec back. Adding a value to an axis is one new
record (and, for a new output profile or regime, its math in the template); nothing else.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import types

def _by_name(*records) -> dict:
    """Records keyed by name, in the given (table) order; a name may be used once."""
    by_name = {r.name: r for r in records}
    if len(by_name) != len(records):
        raise ValueError("spec: two records of one name")
    return by_name


# ---- dtypes and world sizes ---------------------------------------------------------

# Input dtype -> its C++ type in the kernel body.
DTYPE_CPP = {"fp16": "__half", "bf16": "__nv_bfloat16"}
DTYPES = tuple(DTYPE_CPP)
# Bytes of one element of each dtype (a fitted boundary counts bytes per rank: T x hidden x these).
DTYPE_BYTES = {"fp16": 2, "bf16": 2}
# World size 1 exchanges nothing, so the programs fall into two spaces: the local families
# (`local`, `local_streaming`) at world size 1 only, the exchange families at the others
# (world_sizes_of). A family's tables cover its own world sizes; a cell outside them is no hole.
WORLD_SIZES = (1, 2, 4, 8, 16)
LOCAL_WORLD_SIZE = 1
EXCHANGE_WORLD_SIZES = tuple(w for w in WORLD_SIZES if w != LOCAL_WORLD_SIZE)


# ---- output profiles ----------------------------------------------------------------

# The profile of quant=None (only norm_out and residual_out) is called "plain"; every other
# profile is called by its quant= value.
PLAIN = "plain"


@dataclasses.dataclass(frozen=True)
class OutputProfile:
    """What a program writes besides norm_out and residual_out (both in the input dtype)."""
    name: str                   # the call's quant= value, PLAIN for quant=None; also its part of program names
    meaning: str
    cpp: str                    # template argument of the kernel body
    extra_outputs: tuple[str, ...]
    # (routes at a time, shared row first) of the pipelined two-shot with register loads; None:
    # that family is a hole for this profile, where the row ring was faster at every measured T
    # (bench_results/pipelined/row_ring/).
    pipelined_loads: tuple[int, bool] | None

    @property
    def quant(self) -> str | None:
        return None if self.name == PLAIN else self.name


PROFILE_BY_NAME = _by_name(
    OutputProfile(PLAIN, meaning="norm_out + residual_out (input dtype)",
                  cpp="moe_ar::Profile::kPlain", extra_outputs=(), pipelined_loads=None),
    OutputProfile("nvfp4",
                  meaning="norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)",
                  cpp="moe_ar::Profile::kNvfp4", extra_outputs=("quant_out", "scale_out"), pipelined_loads=(4, True)),
    OutputProfile("fp8_group128",
                  meaning="norm_out + residual_out + FP8 E4M3 quant_out + float32 scale_out per 128-element token "
                          "group (row- or column-major, optionally power-of-two)",
                  cpp="moe_ar::Profile::kFp8Group128", extra_outputs=("quant_out", "scale_out"),
                  pipelined_loads=(4, True)),
    OutputProfile("fp8_tensor",
                  meaning="norm_out + residual_out + FP8 E4M3 quant_out with a per-tensor scale given on the device",
                  cpp="moe_ar::Profile::kFp8Tensor", extra_outputs=("quant_out",), pipelined_loads=None),
)
OUTPUT_PROFILES = tuple(PROFILE_BY_NAME)
# Profile name -> the call's quant= argument (a view of the records, for the tests that draw calls).
PROFILE_QUANT = types.MappingProxyType({p.name: p.quant for p in PROFILE_BY_NAME.values()})


# ---- token regimes: the selection ladder --------------------------------------------

@dataclasses.dataclass(frozen=True)
class Regime:
    """One rung of the selection ladder: the exchange that serves a range of token counts T."""
    name: str
    # The selection boundary (a field of each cell's boundaries) that ends this regime's range:
    # it serves T <= that bound, past the rungs before it; None: every larger T (the last rung).
    max_tokens_field: str | None
    cpp: str                    # template argument of the kernel body
    # A work unit of the exchange: "row" (a token row), "slice" (a blockDim-wide slice of a row)
    # or "column" (token j of each rank).
    work_unit: str
    # False: the regime of world size 1, which exchanges nothing; it serves every T there and none
    # elsewhere. Such rungs come first on the ladder.
    exchange: bool = True


# In the order the regimes take over as T grows. First the two regimes of world size 1 (the latency
# layout up to local_max_tokens, the streaming layout above; both 0 elsewhere, so they never run with
# peers; bench_results/world_size_1/). Of the two pipelined two-shots (one kernel regime; they differ
# in how the partials' rows arrive), the one with register loads comes first: more blocks a
# multiprocessor, for the profiles whose norm step is heavy while each block has few columns; where
# it is a hole or slower, loads_max_tokens == twoshot_max_tokens.
LADDER = (
    Regime("local", max_tokens_field="local_max_tokens", cpp="moe_ar::Regime::kLocal", work_unit="row",
           exchange=False),
    Regime("local_streaming", max_tokens_field="streaming_max_tokens", cpp="moe_ar::Regime::kLocalStreaming",
           work_unit="row", exchange=False),
    Regime("oneshot", max_tokens_field="oneshot_max_tokens", cpp="moe_ar::Regime::kOneShot", work_unit="slice"),
    Regime("twoshot_early", max_tokens_field="early_max_tokens", cpp="moe_ar::Regime::kTwoShotEarly",
           work_unit="slice"),
    Regime("twoshot", max_tokens_field="twoshot_max_tokens", cpp="moe_ar::Regime::kTwoShot", work_unit="row"),
    # The two pipelined rungs share one kernel regime: the same exchange, and the program's row_stages
    # (row_stages()) picks how the partials' rows arrive: 0 into registers, > 0 through the row ring.
    Regime("twoshot_pipelined_loads", max_tokens_field="loads_max_tokens", cpp="moe_ar::Regime::kTwoShotPipelined",
           work_unit="column"),
    Regime("twoshot_pipelined", max_tokens_field=None, cpp="moe_ar::Regime::kTwoShotPipelined", work_unit="column"),
)
REGIME_BY_NAME = {r.name: r for r in LADDER}
# The selection boundaries of a cell, in ladder order (one per rung but the last).
BOUNDARY_FIELDS = tuple(r.max_tokens_field for r in LADDER[:-1])
# The rungs that exchange nothing: they come first (their boundaries are all of T at world size 1, 0 elsewhere).
LOCAL_RUNGS = sum(not r.exchange for r in LADDER)
if any(not r.exchange for r in LADDER[LOCAL_RUNGS:]) or not 0 < LOCAL_RUNGS < len(LADDER):
    raise ValueError("spec: the ladder starts with the regimes that exchange nothing, then the exchanges")


# ---- families -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Family:
    """A token regime plus how the shared-expert row is loaded: one table of programs."""
    name: str                   # also its part of program names (moe_ar_<name>_...): words, nothing to decode
    title: str                  # a readable short name
    meaning: str
    base: str                   # the family a hole of this one falls back to (itself for a root)
    # Programs of one protocol class run the same exchange (same buffers, same Lamport sequence);
    # ranks may mix programs of one class in one call.
    protocol: str
    regime: str                 # a REGIME_BY_NAME name
    shared_prefetch: bool       # the shared-expert row is prefetched into L2 and loaded read-only


_SHARED_MEANING = "+ shared-expert row prefetched into L2 before the exchange and loaded read-only"
FAMILY_BY_NAME = _by_name(
    Family("local", title="local, world size 1",
           meaning="world size 1, nothing exchanged: each block finalizes whole token rows in fp32, adds the "
                   "residual, rounds once, then RMSNorm; every load of a row issued before any is used up to 16 "
                   "tokens, four routes at a time above, the token's indices read first (few T)",
           base="local", protocol="local", regime="local", shared_prefetch=False),
    Family("local_streaming", title="local, world size 1, streaming",
           meaning="the local program for many tokens: two blocks a multiprocessor, each loading its row a few "
                   "routes at a time into registers while the other normalizes (large T)",
           base="local", protocol="local", regime="local_streaming", shared_prefetch=False),
    Family("oneshot", title="one-shot",
           meaning="Lamport one-shot: every rank sends its partial to every peer and reduces all tokens itself "
                   "(small T)",
           base="oneshot", protocol="lamport1", regime="oneshot", shared_prefetch=False),
    Family("twoshot", title="two-shot",
           meaning="Lamport two-shot: reduce-scatter to the token's owner, owner adds residual, all-gather "
                   "residual_out; one block per token row in every phase (large T)",
           base="twoshot", protocol="lamport2", regime="twoshot", shared_prefetch=False),
    Family("twoshot_early", title="two-shot, early",
           meaning="two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill "
                   "the GPU (lower two-shot range)",
           base="twoshot", protocol="lamport2", regime="twoshot_early", shared_prefetch=False),
    Family("twoshot_shared", title="two-shot, shared prefetch", meaning=f"twoshot {_SHARED_MEANING}",
           base="twoshot", protocol="lamport2", regime="twoshot", shared_prefetch=True),
    Family("twoshot_early_shared", title="two-shot, early, shared prefetch",
           meaning=f"twoshot_early {_SHARED_MEANING}",
           base="twoshot_early", protocol="lamport2", regime="twoshot_early", shared_prefetch=True),
    Family("twoshot_pipelined", title="pipelined two-shot, row ring",
           meaning="two-shot with its phases pipelined over token columns, so one column's reads overlap the "
                   "exchange of the columns before; no self-traffic through its own buffer, every received vector "
                   "cleared as it is read; the partials' rows come through a ring in shared memory (largest T; "
                   "world size 2)",
           base="twoshot", protocol="lamport2", regime="twoshot_pipelined", shared_prefetch=False),
    Family("twoshot_pipelined_loads", title="pipelined two-shot, register loads",
           meaning="twoshot_pipelined with the partials' rows loaded into registers instead of the ring: more "
                   "blocks a multiprocessor, for the profiles whose norm step is heavy, below the T where the ring "
                   "takes over (world size 2)",
           base="twoshot_pipelined", protocol="lamport2", regime="twoshot_pipelined_loads", shared_prefetch=False),
)
FAMILIES = tuple(FAMILY_BY_NAME)
# The root family of world size 1: with no peers there, every exchange rung of the ladder runs it.
LOCAL_FAMILY = "local"
# Family name -> protocol (a view of the records, for the tests that mix programs of one class).
PROTOCOL = types.MappingProxyType({f.name: f.protocol for f in FAMILY_BY_NAME.values()})


def exchanges(family: str) -> bool:
    """Whether a family's programs exchange anything: all but those of world size 1."""
    return REGIME_BY_NAME[FAMILY_BY_NAME[family].regime].exchange


def world_sizes_of(family: str) -> tuple[int, ...]:
    """The world sizes of a family's space: world size 1 for a local family, the others for an exchange."""
    return EXCHANGE_WORLD_SIZES if exchanges(family) else (LOCAL_WORLD_SIZE,)


def family_for(regime: str, shared_prefetch: bool) -> str | None:
    """The family of a regime, with or without the shared-expert prefetch; None where there is none."""
    return next((family.name for family in FAMILY_BY_NAME.values()
                 if (family.regime, family.shared_prefetch) == (regime, shared_prefetch)), None)


# ---- compilation --------------------------------------------------------------------

# Compile targets: every program compiles for each of these.
ARCH_TARGETS = ("sm_90a", "sm_100a")
# NVRTC options every program is compiled with (besides --gpu-architecture and
# -I<CUDA headers>); the manifest carries them so the runtime compiles alike.
# IEEE fp32 (denormals kept, correctly rounded division): the NVFP4 rule depends on it.
COMPILE_OPTIONS = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "--fmad=true")

# Register caps per (regime, world size); absent: compiled with __launch_bounds__(MAX_THREADS) and
# ptxas chooses. A cap compiles with __maxnreg__(cap); 72 keeps four 224-thread blocks (H 7168) on
# a multiprocessor. The world-size-2 two-shots measured faster capped, spills included; the
# one-shots (the latency range) slower, and world sizes 4 and 8 have no hardware here to measure
# on (bench_results/registers/, bench_results/pipelined/). World size 1: the latency layout (local)
# is uncapped (a row's loads all in registers); the streaming one has its own cap (below).
REGISTER_CAP = {("twoshot", 2): 72, ("twoshot_early", 2): 72, ("twoshot_pipelined_loads", 2): 72}

# World size 1's latency program (local) names the fewest blocks a multiprocessor, one, so ptxas may
# give a thread 128 registers and issues a row's loads before its first addition: its cluster kernel
# always; its one-block kernel where a shape build defines ONE_BLOCK_MIN_BLOCKS_DEFINE (rows of few
# warps, dispatch/shape_constants.py), since with rows of 8 warps and more it measured slower from
# 64-128 tokens, warm L2 most (bench_results/world_size_1/load_order/).
LOCAL_MIN_BLOCKS = 1
ONE_BLOCK_MIN_BLOCKS_DEFINE = "MOE_AR_FIXED_MIN_BLOCKS"

# The pipelined two-shot with the row ring reads its partials' rows through a ring of this many
# rows in shared memory, filled by bulk copies (dynamic shared memory: stages x H x the dtype's
# bytes + 128 for the barriers). No loads in flight in registers, so it compiles under its own cap:
# two 224-thread blocks a multiprocessor (H 7168), no spills. Three rows and two blocks were the
# fastest ring (bench_results/pipelined/row_ring/).
PIPELINED_ROW_STAGES = 3
PIPELINED_RING_CAP = 128
# World size 1's streaming program loads its rows into registers, LOCAL_BATCH_ROUTES routes of every
# vector of the thread at a time, 4 vectors a thread at every T, under a cap that keeps two blocks a
# multiprocessor: one block's epilogue runs under the other's loads (bench_results/world_size_1/
# two_blocks/). Every profile: for FP8 group-128 too, register loads measured as fast as a row ring
# or faster with cold L2 (bench_results/world_size_1/streaming_fp8_group/).
LOCAL_BATCH_ROUTES = 2
LOCAL_TWO_BLOCKS_CAP = 128
# A build of the streaming program for one call shape may name its own cap with this define
# (dispatch/shape_constants.py: rows of few routes run more, smaller blocks a multiprocessor).
STREAMING_CAP_DEFINE = "MOE_AR_FIXED_REGISTER_CAP"

# The one-shot, every profile: four routes at a time, the shared row first
# (bench_results/oneshot/, "Loads in flight"). World size 1: the latency layout loads alike where its
# all-loads path does not apply (local.cuh).
ONESHOT_LOADS = (4, True)
LOCAL_LOADS = ONESHOT_LOADS


def row_stages(family: str, profile: str) -> int:
    """Rows in the shared-memory ring of a program's partials; 0: it loads them into registers."""
    regime = FAMILY_BY_NAME[family].regime
    return PIPELINED_ROW_STAGES if regime == "twoshot_pipelined" else 0


def loads_in_flight(family: str, profile: str) -> tuple[int, bool] | None:
    """(routes at a time, shared row first) of partial_vector, for a one-shot or local program or a
    pipelined two-shot with register loads; None for the others, which load four routes at a time,
    the shared row last (also the pipelined two-shots' fault-injection path, the two-shot's)."""
    regime = FAMILY_BY_NAME[family].regime
    if regime == "oneshot":
        return ONESHOT_LOADS
    if regime == "local":
        return LOCAL_LOADS
    if regime == "local_streaming":
        return (LOCAL_BATCH_ROUTES, False)
    if regime == "twoshot_pipelined_loads":
        return PROFILE_BY_NAME[profile].pipelined_loads
    return None


def register_cap(family: str, world_size: int, profile: str) -> int | None:
    regime = FAMILY_BY_NAME[family].regime
    if row_stages(family, profile):
        return PIPELINED_RING_CAP
    if regime == "local_streaming":
        return LOCAL_TWO_BLOCKS_CAP
    return REGISTER_CAP.get((regime, world_size))


# ---- one program and its names ------------------------------------------------------

PREFIX = "moe_ar"


@dataclasses.dataclass(frozen=True, order=True)
class ProgramSpec:
    """One cell of a family's space: family, dtype, one of its world sizes, output profile (by name)."""
    family: str
    dtype: str
    world_size: int
    profile: str

    def __post_init__(self):
        if self.family not in FAMILY_BY_NAME:
            raise ValueError(f"family: unknown {self.family!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}")
        if self.world_size not in WORLD_SIZES:
            raise ValueError(f"world_size: unknown {self.world_size!r}")
        if self.world_size not in world_sizes_of(self.family):
            raise ValueError(f"world_size: {self.world_size} is outside family {self.family}'s world sizes "
                             f"({', '.join(map(str, world_sizes_of(self.family)))})")
        if self.profile not in PROFILE_BY_NAME:
            raise ValueError(f"profile: unknown {self.profile!r} (one of {', '.join(OUTPUT_PROFILES)})")

    @property
    def name(self) -> str:
        """e.g. moe_ar_twoshot_shared_bf16_ws4_nvfp4, moe_ar_oneshot_bf16_ws2_plain; also the kernel symbol."""
        return f"{PREFIX}_{self.family}_{self.dtype}_ws{self.world_size}_{self.profile}"

    @property
    def symbol(self) -> str:
        return self.name

    @property
    def cluster_symbol(self) -> str | None:
        """The second kernel of world size 1's latency programs: its cluster layout (few tokens)."""
        return f"{self.name}_cluster" if FAMILY_BY_NAME[self.family].regime == "local" else None

    @property
    def file_name(self) -> str:
        return f"programs/{self.name}.cu"

    @property
    def protocol_class(self) -> str:
        return f"{FAMILY_BY_NAME[self.family].protocol}_{self.dtype}_ws{self.world_size}"

    @property
    def base_family(self) -> str:
        return FAMILY_BY_NAME[self.family].base


# Program names spelled the family by a code until they spelled its name; the measurement files
# under bench_results/ keep the names they were measured under, which parse_recorded reads.
FAMILY_CODES_BEFORE_WORDS = types.MappingProxyType({
    "lc": "local", "lcs": "local_streaming", "os": "oneshot", "ts": "twoshot", "tse": "twoshot_early",
    "tss": "twoshot_shared", "tses": "twoshot_early_shared", "tsp": "twoshot_pipelined",
    "tspl": "twoshot_pipelined_loads"})
if (set(FAMILY_CODES_BEFORE_WORDS.values()) - set(FAMILY_BY_NAME)
        or set(FAMILY_CODES_BEFORE_WORDS) & set(FAMILY_BY_NAME)):
    raise ValueError("spec: an old family code names no family, or is a family name itself")
_FAMILY_NAMES = types.MappingProxyType({family: family for family in FAMILY_BY_NAME})
# <prefix>_<family>_<dtype>_ws<world size>_<profile>; a family name may hold underscores, a dtype none.
_NAME_RE = re.compile(rf"^{PREFIX}_([a-z0-9_]+?)_({'|'.join(DTYPES)})_ws(\d+)_([a-z0-9_]+)$")


def _parse(name: str, families) -> ProgramSpec | None:
    match = _NAME_RE.match(name)
    if not match or match.group(1) not in families or match.group(4) not in PROFILE_BY_NAME:
        return None
    try:
        cell = ProgramSpec(families[match.group(1)], match.group(2), int(match.group(3)), match.group(4))
    except ValueError:
        return None
    return cell if name == f"{PREFIX}_{match.group(1)}_{cell.dtype}_ws{cell.world_size}_{cell.profile}" else None


def parse(name: str) -> ProgramSpec:
    """The spec of a program name (today's names only)."""
    cell = _parse(name, _FAMILY_NAMES)
    if cell is None:
        raise ValueError(f"name: {name!r} is not a program name like {PREFIX}_twoshot_bf16_ws2_plain")
    return cell


def parse_recorded(name: str) -> ProgramSpec:
    """parse, and also the names measurement files recorded with a family code (moe_ar_tses_bf16_ws4_plain
    is moe_ar_twoshot_early_shared_bf16_ws4_plain): for reading measured data, never for naming."""
    cell = _parse(name, _FAMILY_NAMES) or _parse(name, FAMILY_CODES_BEFORE_WORDS)
    if cell is None:
        raise ValueError(f"name: {name!r} is not a program name like {PREFIX}_twoshot_bf16_ws2_plain "
                         f"(or its code form, {PREFIX}_ts_bf16_ws2_plain)")
    return cell


def all_cells():
    """Every cell of every family's space (family, dtype, world size, profile), in fixed table order."""
    for family in FAMILIES:
        for dtype, world_size, profile in itertools.product(DTYPES, world_sizes_of(family), OUTPUT_PROFILES):
            yield ProgramSpec(family, dtype, world_size, profile)
