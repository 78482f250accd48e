"""The kernel argument plan: one by-value struct, described once.

The template renders this list into the C++ `Params` struct and the manifest
carries it, so the runtime builds the matching ctypes structure from the
manifest alone. Fields are ordered by size so C and ctypes agree on padding.
"""
from __future__ import annotations

MAX_WORLD_SIZE = 16

# (field, C type, ctypes type name, meaning)
PARAMS = (
    ("allreduce_in", "const void*", "c_void_p", "[R, H] dtype, permuted expert rows (this rank's partials)"),
    ("expanded_idx", "const int*", "c_void_p", "[T, K] int32 row of allreduce_in per (token, route); < 0 = dropped"),
    ("expert_scale", "const void*", "c_void_p", "[T, K] dtype or fp32 router weights, or null (= 1)"),
    ("shared_in", "const void*", "c_void_p", "[T, H] dtype shared-expert partial, or null"),
    ("residual_in", "const void*", "c_void_p", "[T, H] dtype"),
    ("norm_weight", "const void*", "c_void_p", "[H] dtype RMSNorm gamma"),
    ("quant_scale", "const float*", "c_void_p", "[1] fp32: NVFP4 global scale (nvfp4), FP8 per-tensor scale (fp8_tensor), else null"),
    ("norm_out", "void*", "c_void_p", "[T, H] dtype"),
    ("residual_out", "void*", "c_void_p", "[T, H] dtype"),
    ("quant_out", "void*", "c_void_p", "[T, H/2] uint8 packed E2M1 (nvfp4); [T, H] FP8 E4M3 (fp8_*); else null"),
    ("scale_out", "void*", "c_void_p", "swizzled 128x4 E4M3 scales (nvfp4); fp32 group scales (fp8_group128); else null"),
    ("peer_buffers", f"void*[{MAX_WORLD_SIZE}]", f"c_void_p*{MAX_WORLD_SIZE}",
     "Lamport buffer base of every rank (3 rotating buffers each), by rank"),
    ("state", "unsigned*", "c_void_p", "this rank's device state words (call counter, extents, done counter, poisoned, skipped loads)"),
    ("error", "unsigned*", "c_void_p", "host-mapped error words: code, phase, rank, bad-index count"),
    ("buffer_elems", "long long", "c_int64", "elements of dtype in one rotating buffer"),
    ("timeout_ns", "unsigned long long", "c_uint64", "deadline for any wait on a peer, in ns (0 = none)"),
    ("tokens", "int", "c_int32", "T"),
    ("hidden", "int", "c_int32", "H"),
    ("top_k", "int", "c_int32", "K"),
    ("rows", "int", "c_int32", "R, rows of allreduce_in (indices >= R are skipped and counted)"),
    ("rank", "int", "c_int32", "this rank"),
    ("scale_kind", "int", "c_int32", "0: no expert_scale, 1: fp32, 2: dtype"),
    ("vec_per_thread", "int", "c_int32", "16-byte vectors of a row held by one thread"),
    ("quant_flags", "int", "c_int32", "fp8_group128: 1 = column-major scales [H/128, roundup(T, 4)], 2 = power-of-two scales"),
    ("fault_stop_after", "int", "c_int32", "fault injection for tests: > 0 sends only that many phase-1 units, then stops; 0 normally"),
    ("routed_scaling_factor", "float", "c_float", "multiplies the routed sum"),
    ("eps", "float", "c_float", "RMSNorm epsilon"),
    ("weight_bias", "float", "c_float", "0, or 1 for (1 + gamma)"),
)

# Words and bits the kernels and the runtime share, rendered into params.cuh as C++ enums and into
# the manifest's "constants", from which the runtime reads them: (enum, what it numbers, entries of
# (C++ name, value, meaning)).
SHARED_ENUMS = (
    ("StateWord", "a rank's device state words (Params.state), 32-bit each", (
        ("kCallCounter", 0, "the call counter (buffers rotate by call % 3)"),
        ("kExtent0", 1, "kExtent0 + b: the extent the last call wrote into buffer b, in 16-byte vectors"),
        ("kDoneBlocks", 4, "blocks of this call done (the last one ends the call)"),
        ("kPoisoned", 5, "0, or 1 + the call counter of the call in which a wait timed out"),
        ("kBadRows", 6, "skipped out-of-range route loads, 64-bit: words 6 (low) and 7 (high)"),
        ("kStateWords", 8, "the number of state words"))),
    ("ErrorWord", "the host-mapped error words (Params.error)", (
        ("kErrCode", 0, "an ErrorCode"),
        ("kErrPhase", 1, "the Phase the wait timed out in"),
        ("kErrRank", 2, "the rank that timed out"),
        ("kErrorWords", 4, "the number of error words (one spare)"))),
    ("ErrorCode", "what the error words report", (
        ("kErrNone", 0, "no error"),
        ("kErrTimeout", 1, "a wait for a peer timed out"))),
    ("Phase", "where a call waits for its peers", (
        ("kPhaseNone", 0, "none"),
        ("kPhaseReduceScatter", 1, "reduce-scatter (waiting for peers' partials)"),
        ("kPhaseAllGather", 2, "all-gather (waiting for the owners' residual_out rows)"),
        ("kPhaseOneShot", 3, "one-shot (waiting for peers' partials)"))),
    ("QuantFlag", "bits of Params.quant_flags (profile fp8_group128)", (
        ("kScalesColumnMajor", 1, "scale_out column-major"),
        ("kScalesPow2", 2, "power-of-two scales"))),
)


def shared_enums() -> list[dict]:
    """SHARED_ENUMS as the template and the manifest take them."""
    return [{"name": name, "what": what, "entries": [{"name": n, "value": v, "meaning": m} for n, v, m in entries]}
            for name, what, entries in SHARED_ENUMS]


# Launch limits shared by the template (rendered in) and the runtime (through the manifest):
# a row of H elements is held by at most MAX_THREADS threads x MAX_VEC_PER_THREAD 16-byte vectors,
# so H <= MAX_THREADS * MAX_VEC_PER_THREAD * 8 = 16384.
MAX_THREADS = 512
MAX_VEC_PER_THREAD = 4
MAX_HIDDEN = MAX_THREADS * MAX_VEC_PER_THREAD * 8
REGISTERS_PER_SM = 65536  # sm_90 and sm_100
# The row split the runtime picks per call (a workspace may fix one instead): up to
# FEW_TOKENS_MAX tokens, FEW_TOKENS_VEC_PER_THREAD vectors a thread (more threads on a row, a
# shorter critical path), above, MAX_VEC_PER_THREAD (the fewest threads, the most loads in flight a
# thread: better once the GPU is full). One boundary for every profile, where plain, NVFP4 and
# FP8-group all gain (bench_results/latency/), so ranks that mix programs still split rows alike;
# every rank of a call has the same T, so every rank picks the same split.
FEW_TOKENS_MAX = 256
FEW_TOKENS_VEC_PER_THREAD = 2
# World size 1's latency program (local) spreads each token over a cluster of blocks, for rows of
# CLUSTER_MIN_WARPS warps or more (H >= 2048 under the few-tokens split): C <= CLUSTER_MAX_BLOCKS
# blocks, the largest that divides the one-block split's warps, one vector a thread
# (dispatch/workspace_sizes.py cluster_layout_split). Rows of CLUSTER_ROUND_MIN_WARPS warps or more
# (H >= 6144) round their one-block split up to a multiple of CLUSTER_MAX_BLOCKS warps where that
# fits a block (cluster_row_split; H 7168: 16 warps, not 14) and take the cluster layout up to
# CLUSTER_MAX_TOKENS tokens (faster than one block at H 7168 up to there, level or slower above:
# bench_results/world_size_1/cluster_one_vector/). Smaller rows load less a token, so the spread pays
# to fewer tokens, and fewer still with fewer routes: up to CLUSTER_SMALL_ROW_MANY_ROUTES_MAX_TOKENS
# at top_k >= CLUSTER_MANY_ROUTES_TOP_K, else up to CLUSTER_SMALL_ROW_MAX_TOKENS, about where plain
# breaks even with fewer routes (NVFP4 at H 4096 top_k 2 is slower from 2 tokens all the same):
# bench_results/world_size_1/small_rows_limit/.
CLUSTER_MAX_TOKENS = 48
CLUSTER_SMALL_ROW_MAX_TOKENS = 16
CLUSTER_SMALL_ROW_MANY_ROUTES_MAX_TOKENS = 32
CLUSTER_MANY_ROUTES_TOP_K = 8
CLUSTER_MAX_BLOCKS = 8
CLUSTER_MIN_WARPS = 4
CLUSTER_ROUND_MIN_WARPS = 12
# Its one-block layout issues every load of a row at once (one memory latency) up to
# ALL_LOADS_MAX_TOKENS tokens; above, with a block on nearly every multiprocessor, every load at once
# measured slower than four routes at a time with the token's indices read first
# (bench_results/world_size_1/mid_tokens/). Its builds for one call shape (dispatch/shape_constants.py)
# issue every load at once at every T they serve (MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS, kernels/local.cuh).
ALL_LOADS_MAX_TOKENS = 16
