// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/selection.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Table set h200_nvlink: NVIDIA H200, NVLink (2x H200 at world size 2, one H200 at world size 1).
// For product 'NVIDIA H200', compute capability 9.0, interconnect nvlink (dispatch/table_sets.py picks the set for a device).
// Measured in bench_results/h200x2-2026-11-30-529cb84-bf16.json: NVIDIA H200 x2, peer 388 GB/s, driver 580.159.04, cuda 13.0, torch 2.11.0+cu130, commit 529cb84
// Measured in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: NVIDIA H200 x1, sm 9.0, none, driver 580.159.04, cuda 13.0, torch 2.11.0+cu130, nvrtc 13.0, commit a764809
// Selection for a call with T tokens:
// T <= local_max_tokens: local; T <= streaming_max_tokens: local_streaming; T
// <= oneshot_max_tokens: oneshot; T <= early_max_tokens: twoshot_early; T <=
// twoshot_max_tokens: twoshot; T <= loads_max_tokens: twoshot_pipelined_loads;
// else twoshot_pipelined; then the shared-expert variant where the rank has a
// shared operand; a hole falls back to its fallback_family; at world size 1
// (no peers) every exchange rung runs local, so a ladder may return to the
// latency layout after the streaming one
// Each cell: {key, measured from, measured to, {its rungs' boundaries}}.
// kTokens counts T; kBytesPerRank counts T x hidden x element bytes, which the
// runtime turns into tokens for its workspace. Outside the measured range (0,
// 0: not measured) the runtime serves a call from the next set of its chain
// (generator/table_sets.py, dispatch/table_sets.py). World size 1 and the
// exchange world sizes are two grids: each holds the boundaries of the rungs
// that can run there.
constexpr int kAllTokens = 2147483647;  // no upper bound: the regime runs every larger T (or byte count)
enum BoundaryKey { kTokens, kBytesPerRank };

// World size 1, nothing exchanged: the local rungs' boundaries; above them
// every rung runs local (no peers): {key, measured from, measured to,
// {local_max_tokens, streaming_max_tokens}}.
// [dtype: fp16, bf16][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
struct LocalBoundaries { BoundaryKey key; long long measured_from, measured_to; long long max[2]; };
static const LocalBoundaries kLocalBoundaries[2][4] = {
    {  // fp16
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // fp16 ws1 plain: measured (bf16 data) in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.000x, mean 1.000x; own boundaries at hidden 2048, 4096
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // fp16 ws1 nvfp4: measured (bf16 data) in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.007x, mean 1.000x; own boundaries at hidden 4096
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // fp16 ws1 fp8_group128: measured (bf16 data) in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.000x, mean 1.000x; own boundaries at hidden 2048, 4096
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // fp16 ws1 fp8_tensor: measured (bf16 data) in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.017x, mean 1.000x; own boundaries at hidden 4096
    },
    {  // bf16
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // bf16 ws1 plain: measured in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.000x, mean 1.000x; own boundaries at hidden 2048, 4096
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // bf16 ws1 nvfp4: measured in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.007x, mean 1.000x; own boundaries at hidden 4096
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // bf16 ws1 fp8_group128: measured in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.000x, mean 1.000x; own boundaries at hidden 2048, 4096
        {kBytesPerRank, 4096, 234881024, {1835008, kAllTokens}},  // bf16 ws1 fp8_tensor: measured in bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.017x, mean 1.000x; own boundaries at hidden 4096
    },
};
// Boundaries of their own for the hidden sizes measured where one set of boundaries cannot serve
// every row size ([dtype][output profile] indexes as above, hidden, its measured range in the cell's key,
// its boundaries): a workspace of that hidden size takes these instead of the cell's.
struct LocalHiddenBoundaries { int dtype, profile, hidden; long long measured_from, measured_to, max[2]; };
static const LocalHiddenBoundaries kLocalHiddenBoundaries[] = {
    {0, 0, 2048, 4096, 67108864, {2097152, kAllTokens}},  // fp16 ws1 plain at hidden 2048
    {0, 0, 4096, 8192, 134217728, {2097152, kAllTokens}},  // fp16 ws1 plain at hidden 4096
    {0, 1, 4096, 8192, 134217728, {2097152, kAllTokens}},  // fp16 ws1 nvfp4 at hidden 4096
    {0, 2, 2048, 4096, 67108864, {2097152, kAllTokens}},  // fp16 ws1 fp8_group128 at hidden 2048
    {0, 2, 4096, 8192, 134217728, {2097152, kAllTokens}},  // fp16 ws1 fp8_group128 at hidden 4096
    {0, 3, 4096, 8192, 134217728, {2097152, kAllTokens}},  // fp16 ws1 fp8_tensor at hidden 4096
    {1, 0, 2048, 4096, 67108864, {2097152, kAllTokens}},  // bf16 ws1 plain at hidden 2048
    {1, 0, 4096, 8192, 134217728, {2097152, kAllTokens}},  // bf16 ws1 plain at hidden 4096
    {1, 1, 4096, 8192, 134217728, {2097152, kAllTokens}},  // bf16 ws1 nvfp4 at hidden 4096
    {1, 2, 2048, 4096, 67108864, {2097152, kAllTokens}},  // bf16 ws1 fp8_group128 at hidden 2048
    {1, 2, 4096, 8192, 134217728, {2097152, kAllTokens}},  // bf16 ws1 fp8_group128 at hidden 4096
    {1, 3, 4096, 8192, 134217728, {2097152, kAllTokens}},  // bf16 ws1 fp8_tensor at hidden 4096
};

// World sizes 2, 4, 8, 16: the exchange rungs' boundaries (the local rungs
// serve no T with peers): {key, measured from, measured to,
// {oneshot_max_tokens, early_max_tokens, twoshot_max_tokens,
// loads_max_tokens}}.
// [dtype: fp16, bf16][world size: 2, 4, 8, 16][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
struct ExchangeBoundaries { BoundaryKey key; long long measured_from, measured_to; long long max[4]; };
static const ExchangeBoundaries kExchangeBoundaries[2][4][4] = {
    {  // fp16
        {  // fp16 ws2
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 4194304}},  // fp16 ws2 plain: measured (bf16 data) in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.027x, mean 1.001x
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 14680064}},  // fp16 ws2 nvfp4: measured (bf16 data) in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.005x, mean 1.000x
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 4194304}},  // fp16 ws2 fp8_group128: measured (bf16 data) in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.044x, mean 1.002x
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 4194304}},  // fp16 ws2 fp8_tensor: measured (bf16 data) in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.036x, mean 1.001x
        },
        {  // fp16 ws4
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // fp16 ws4 plain: written model
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // fp16 ws4 nvfp4: written model
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // fp16 ws4 fp8_group128: written model
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // fp16 ws4 fp8_tensor: written model
        },
        {  // fp16 ws8
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // fp16 ws8 plain: written model
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // fp16 ws8 nvfp4: written model
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // fp16 ws8 fp8_group128: written model
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // fp16 ws8 fp8_tensor: written model
        },
        {  // fp16 ws16
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // fp16 ws16 plain: written model
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // fp16 ws16 nvfp4: written model
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // fp16 ws16 fp8_group128: written model
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // fp16 ws16 fp8_tensor: written model
        },
    },
    {  // bf16
        {  // bf16 ws2
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 4194304}},  // bf16 ws2 plain: measured in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.027x, mean 1.001x
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 14680064}},  // bf16 ws2 nvfp4: measured in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.005x, mean 1.000x
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 4194304}},  // bf16 ws2 fp8_group128: measured in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.044x, mean 1.002x
            {kBytesPerRank, 8192, 234881024, {4194304, 4194304, 4194304, 4194304}},  // bf16 ws2 fp8_tensor: measured in bench_results/h200x2-2026-11-30-529cb84-bf16.json: 0 of 60 points over 1.05x the best program (0 at the target shape), at most 1.036x, mean 1.001x
        },
        {  // bf16 ws4
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // bf16 ws4 plain: written model
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // bf16 ws4 nvfp4: written model
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // bf16 ws4 fp8_group128: written model
            {kTokens, 0, 0, {64, 1024, kAllTokens, kAllTokens}},  // bf16 ws4 fp8_tensor: written model
        },
        {  // bf16 ws8
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // bf16 ws8 plain: written model
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // bf16 ws8 nvfp4: written model
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // bf16 ws8 fp8_group128: written model
            {kTokens, 0, 0, {16, 2048, kAllTokens, kAllTokens}},  // bf16 ws8 fp8_tensor: written model
        },
        {  // bf16 ws16
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // bf16 ws16 plain: written model
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // bf16 ws16 nvfp4: written model
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // bf16 ws16 fp8_group128: written model
            {kTokens, 0, 0, {8, 4096, kAllTokens, kAllTokens}},  // bf16 ws16 fp8_tensor: written model
        },
    },
};
// No cell here has boundaries of its own per hidden size.
