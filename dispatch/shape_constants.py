"""World size 1's programs compiled for one call shape: what a workspace's launcher of the latency
program runs for calls of up to MAX_TOKENS tokens, and of the streaming program for calls of top_k 8
(up to each profile's STREAMING_MAX_HIDDEN), and of top_k 1-2 at H <= 4096 with their own row split
(few_routes) (unless the environment has MOE_AR_SHAPE_CONSTANTS=0 when the launcher is made).

At a few tokens a block of the latency program runs one warp a scheduler, so the instructions that
check the call's shape at run time (vectors past the row, routes past top_k, the router weights'
kind) are on the critical path. The launcher compiles the program's source once per (top_k, router
weight kind) of the calls it serves, with the workspace's hidden size and row split and the call's
top_k and weight kind as constants (the MOE_AR_FIXED_* defines first in the source, read by
kernels/shape.cuh, kernels/vector.cuh and kernels/local.cuh). The same loads, additions and order as
the program without them: the same bits. A build's one-block rows issue every load at once at every
T it serves (MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS); the program without constants does so up to 16
tokens only, above which it measured slower. Each build is a cubin cache entry of its own (the
defines are part of the source the cache key hashes); the build happens when a call signature is
first checked, never on the launch path.

Where they serve (each where it measured as fast as the program or faster at nearly every point;
the READMEs named give the exceptions):
- the latency program, up to MAX_TOKENS (bench_results/world_size_1/all_loads/ and
  few_routes_group/). The committed tables end the latency range by MAX_TOKENS at H 1024 and above;
  smaller rows may run it further, as the program.
- the streaming program at top_k 8 (bench_results/world_size_1/stream_ring/), not at top_k 2 on the
  program's split, nor FP8 group-128 above H 4096: STREAMING_MAX_HIDDEN holds each profile's largest
  hidden size (bench_results/world_size_1/group_builds/).
- the streaming program at top_k 1-2, H <= 4096, 2 vectors a thread under 64 registers
  (bench_results/world_size_1/few_routes/ and few_routes_group/).
"""
from __future__ import annotations

import os

ENV = "MOE_AR_SHAPE_CONSTANTS"
SCALE_KINDS = (0, 1, 2)  # Params.scale_kind: no router weights, float32, the dtype
MAX_TOKENS = 1024  # calls of more tokens run the program as built for every shape


def enabled() -> bool:
    """Whether launchers build per call shape: yes unless the environment says "0" (unset, "" or "1": yes)."""
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}: {value!r}, expected 0 or 1")
    return value != "0"


# The latency program's one-block kernel, for calls of up to ONE_BLOCK_MIN_BLOCKS_MAX_TOKENS tokens
# at rows of 2 vectors a thread and ONE_BLOCK_MIN_BLOCKS_MAX_THREADS threads or fewer (H 2048 and
# below), is built bound to one block a multiprocessor at least (ONE_BLOCK_MIN_BLOCKS_DEFINE,
# generator/spec.py LOCAL_MIN_BLOCKS): ptxas then gives a thread 128 registers and issues a row's
# loads before its first addition, where it issued 8 of 20: faster there with cold L2, a little
# slower with warm L2; at 256 tokens and at rows of 8 warps and more it measured slower
# (bench_results/world_size_1/load_order/). Calls of more tokens run a build without the bound.
ONE_BLOCK_MIN_BLOCKS_MAX_TOKENS = 128
ONE_BLOCK_MIN_BLOCKS_MAX_THREADS = 128
ONE_BLOCK_MIN_BLOCKS_VEC_PER_THREAD = 2
ONE_BLOCK_MIN_BLOCKS_DEFINE = "MOE_AR_FIXED_MIN_BLOCKS"


def one_block_min_blocks(vec_per_thread: int, threads: int, T: int) -> int | None:
    """The fewest blocks a multiprocessor the one-block build for a call of T tokens at this row split
    names (None: none)."""
    small = (vec_per_thread == ONE_BLOCK_MIN_BLOCKS_VEC_PER_THREAD and threads <= ONE_BLOCK_MIN_BLOCKS_MAX_THREADS
             and T <= ONE_BLOCK_MIN_BLOCKS_MAX_TOKENS)
    return 1 if small else None


STREAMING_TOP_K = 8  # the top_k the streaming program's builds serve
# the profiles whose streaming program builds, each with the largest hidden size where it does
STREAMING_MAX_HIDDEN = {"plain": 1 << 14, "nvfp4": 1 << 14, "fp8_tensor": 1 << 14, "fp8_group128": 1 << 12}
STREAMING_PROFILES = tuple(STREAMING_MAX_HIDDEN)


# Rows of few routes: the streaming program's build for a call of top_k <= FEW_ROUTES_MAX_TOP_K at
# H <= FEW_ROUTES_MAX_HIDDEN, in a profile of FEW_ROUTES_PROFILES, splits the row at 2 vectors a thread
# under a cap of 64 registers (H 4096: 4 blocks of 8 warps a multiprocessor, not 4 of 4 warps), where
# the workspace does not fix the split: with two routes a token the row's loads do not fill a
# multiprocessor's loads in flight, more warps a token do. At top_k 8 it measured slower
# (bench_results/world_size_1/small_rows_streaming/). FP8 group-128's fits the cap without a spill at
# top_k 1-2 (it spills at top_k 8).
FEW_ROUTES_MAX_TOP_K = 2
FEW_ROUTES_MAX_HIDDEN = 4096
FEW_ROUTES_PROFILES = ("plain", "nvfp4", "fp8_tensor", "fp8_group128")
FEW_ROUTES_VEC_PER_THREAD = 2
FEW_ROUTES_REGISTER_CAP = 64
REGISTER_CAP_DEFINE = "MOE_AR_FIXED_REGISTER_CAP"
# Where the few-routes build serves a call, the latency program's range ends at this many tokens,
# whatever the table (fitted at top_k 8): past it the build was faster than the latency program at
# H 1024-4096 top_k 2, level with it at 128-256 tokens (bench_results/world_size_1/top_k_handover/
# and few_routes_group/). dispatch.select_program applies it.
FEW_ROUTES_LATENCY_MAX_TOKENS = 256


def few_routes(regime: str, profile: str, hidden: int) -> bool:
    """Whether a launcher of a program of `regime` and `profile` on a row of `hidden` builds its calls of
    top_k <= FEW_ROUTES_MAX_TOP_K as the few-routes build (its own split and register cap), where the
    workspace leaves the split free."""
    from . import registry
    return (regime == registry.LOCAL_STREAMING_REGIME and hidden <= FEW_ROUTES_MAX_HIDDEN
            and profile in FEW_ROUTES_PROFILES)


def serves(regime: str, T: int, top_k: int, few_routes_call: bool = False) -> bool:
    """Whether a call of T tokens and top_k routes runs a shape build (where the launcher has them);
    `few_routes_call`: the launcher runs this call as its few-routes build (its takes_few_routes)."""
    from . import registry
    if regime == registry.LOCAL_LATENCY_REGIME:
        return T <= MAX_TOKENS
    return regime == registry.LOCAL_STREAMING_REGIME and (top_k == STREAMING_TOP_K or few_routes_call)


def applies(regime: str, row_splits, profile: str, hidden: int) -> bool:
    """Whether a launcher of a program of `regime` and `profile` with these row splits, on a workspace
    of `hidden`, builds per call shape: the switch is not off, the program is world size 1's latency
    program, or its streaming program of a profile of STREAMING_MAX_HIDDEN up to its hidden size, and
    it runs one row split."""
    from . import registry
    if not enabled() or len(row_splits) != 1:
        return False
    return regime == registry.LOCAL_LATENCY_REGIME or (regime == registry.LOCAL_STREAMING_REGIME
                                                       and hidden <= STREAMING_MAX_HIDDEN.get(profile, 0))


def defines(hidden: int, top_k: int, scale_kind: int, vec_per_thread: int, threads: int,
            min_blocks: int | None = None, register_cap: int | None = None) -> str:
    """The lines put before the program's source: a row of `hidden` elements held by `threads`
    threads, `vec_per_thread` 16-byte vectors each, `top_k` routes, router weights of `scale_kind`;
    with `min_blocks`, the fewest blocks a multiprocessor the one-block kernel's bound names; with
    `register_cap`, the streaming program's cap in registers a thread."""
    for name, value, low, high in (("hidden", hidden, 16, 1 << 14), ("top_k", top_k, 1, 16),
                                   ("vec_per_thread", vec_per_thread, 1, 4), ("threads", threads, 32, 1024)):
        if type(value) is not int or not low <= value <= high:
            raise ValueError(f"{name}: {value!r}, expected an int in [{low}, {high}]")
    if scale_kind not in SCALE_KINDS or type(scale_kind) is not int:
        raise ValueError(f"scale_kind: {scale_kind!r}, expected one of {SCALE_KINDS}")
    if min_blocks is not None and (type(min_blocks) is not int or not 1 <= min_blocks <= 32):
        raise ValueError(f"min_blocks: {min_blocks!r}, expected None or an int in [1, 32]")
    if register_cap is not None and (type(register_cap) is not int or not 32 <= register_cap <= 255):
        raise ValueError(f"register_cap: {register_cap!r}, expected None or an int in [32, 255]")
    if hidden % 16 or threads % 32 or threads * vec_per_thread * 8 < hidden:
        raise ValueError(f"threads: {threads} threads of {vec_per_thread} vectors do not hold a row of {hidden}")
    return (f"#define MOE_AR_FIXED_HIDDEN {hidden}\n#define MOE_AR_FIXED_TOP_K {top_k}\n"
            f"#define MOE_AR_FIXED_SCALE_KIND {scale_kind}\n#define MOE_AR_FIXED_VEC_PER_THREAD {vec_per_thread}\n"
            f"#define MOE_AR_FIXED_ROW_THREADS {threads}\n#define MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS {MAX_TOKENS}\n"
            + ("" if min_blocks is None else f"#define {ONE_BLOCK_MIN_BLOCKS_DEFINE} {min_blocks}\n")
            + ("" if register_cap is None else f"#define {REGISTER_CAP_DEFINE} {register_cap}\n"))
