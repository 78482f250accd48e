// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/selection.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Table set model: the written model (generator/tuning.py), for devices no set matches.
// For any device (the last fallback) (dispatch/table_sets.py picks the set for a device).
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
        {kTokens, 0, 0, {256, kAllTokens}},  // fp16 ws1 plain: written model
        {kTokens, 0, 0, {256, kAllTokens}},  // fp16 ws1 nvfp4: written model
        {kTokens, 0, 0, {256, kAllTokens}},  // fp16 ws1 fp8_group128: written model
        {kTokens, 0, 0, {256, kAllTokens}},  // fp16 ws1 fp8_tensor: written model
    },
    {  // bf16
        {kTokens, 0, 0, {256, kAllTokens}},  // bf16 ws1 plain: written model
        {kTokens, 0, 0, {256, kAllTokens}},  // bf16 ws1 nvfp4: written model
        {kTokens, 0, 0, {256, kAllTokens}},  // bf16 ws1 fp8_group128: written model
        {kTokens, 0, 0, {256, kAllTokens}},  // bf16 ws1 fp8_tensor: written model
    },
};
// No cell here has boundaries of its own per hidden size.

// World sizes 2, 4, 8, 16: the exchange rungs' boundaries (the local rungs
// serve no T with peers): {key, measured from, measured to,
// {oneshot_max_tokens, early_max_tokens, twoshot_max_tokens,
// loads_max_tokens}}.
// [dtype: fp16, bf16][world size: 2, 4, 8, 16][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
struct ExchangeBoundaries { BoundaryKey key; long long measured_from, measured_to; long long max[4]; };
static const ExchangeBoundaries kExchangeBoundaries[2][4][4] = {
    {  // fp16
        {  // fp16 ws2
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // fp16 ws2 plain: written model
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // fp16 ws2 nvfp4: written model
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // fp16 ws2 fp8_group128: written model
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // fp16 ws2 fp8_tensor: written model
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
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // bf16 ws2 plain: written model
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // bf16 ws2 nvfp4: written model
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // bf16 ws2 fp8_group128: written model
            {kTokens, 0, 0, {64, 512, kAllTokens, kAllTokens}},  // bf16 ws2 fp8_tensor: written model
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
