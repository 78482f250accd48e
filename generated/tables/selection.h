// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/selection.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Regime boundaries per cell, {local_max_tokens, oneshot_max_tokens,
// early_max_tokens, twoshot_max_tokens, loads_max_tokens}; source:
// cells measured in bench_results/h200x2-2026-11-30-529cb84-bf16.json, the rest from the written model (generator/tuning.py). Selection for a call with T tokens:
// T <= local_max_tokens: local; T <= oneshot_max_tokens: oneshot; T <=
// early_max_tokens: twoshot_early; T <= twoshot_max_tokens: twoshot; T <=
// loads_max_tokens: twoshot_pipelined_loads; else twoshot_pipelined; then the
// shared-expert variant where the rank has a shared operand; a hole falls back
// to its fallback_family
// [dtype: fp16, bf16][world size: 1, 2, 4, 8, 16][output profile: plain, nvfp4, fp8_group128, fp8_tensor][local_max_tokens, oneshot_max_tokens, early_max_tokens, twoshot_max_tokens, loads_max_tokens]
constexpr int kAllTokens = 2147483647;  // no upper bound: the regime runs every larger T
static const int kRegimeBoundaries[2][5][4][5] = {
    {  // fp16
        {  // fp16 ws1
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // fp16 ws1 plain: written model (nothing to exchange: local runs every T)
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // fp16 ws1 nvfp4: written model (nothing to exchange: local runs every T)
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // fp16 ws1 fp8_group128: written model (nothing to exchange: local runs every T)
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // fp16 ws1 fp8_tensor: written model (nothing to exchange: local runs every T)
        },
        {  // fp16 ws2
            {0, 512, 512, 512, 512},  // fp16 ws2 plain: measured (bf16 data): 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.069x, mean 1.001x
            {0, 256, 256, 256, 1024},  // fp16 ws2 nvfp4: measured (bf16 data): 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.135x, mean 1.002x
            {0, 512, 512, 512, 512},  // fp16 ws2 fp8_group128: measured (bf16 data): 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.068x, mean 1.002x
            {0, 512, 512, 512, 512},  // fp16 ws2 fp8_tensor: measured (bf16 data): 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.060x, mean 1.001x
        },
        {  // fp16 ws4
            {0, 64, 1024, kAllTokens, kAllTokens},  // fp16 ws4 plain: written model
            {0, 64, 1024, kAllTokens, kAllTokens},  // fp16 ws4 nvfp4: written model
            {0, 64, 1024, kAllTokens, kAllTokens},  // fp16 ws4 fp8_group128: written model
            {0, 64, 1024, kAllTokens, kAllTokens},  // fp16 ws4 fp8_tensor: written model
        },
        {  // fp16 ws8
            {0, 16, 2048, kAllTokens, kAllTokens},  // fp16 ws8 plain: written model
            {0, 16, 2048, kAllTokens, kAllTokens},  // fp16 ws8 nvfp4: written model
            {0, 16, 2048, kAllTokens, kAllTokens},  // fp16 ws8 fp8_group128: written model
            {0, 16, 2048, kAllTokens, kAllTokens},  // fp16 ws8 fp8_tensor: written model
        },
        {  // fp16 ws16
            {0, 8, 4096, kAllTokens, kAllTokens},  // fp16 ws16 plain: written model
            {0, 8, 4096, kAllTokens, kAllTokens},  // fp16 ws16 nvfp4: written model
            {0, 8, 4096, kAllTokens, kAllTokens},  // fp16 ws16 fp8_group128: written model
            {0, 8, 4096, kAllTokens, kAllTokens},  // fp16 ws16 fp8_tensor: written model
        },
    },
    {  // bf16
        {  // bf16 ws1
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // bf16 ws1 plain: written model (nothing to exchange: local runs every T)
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // bf16 ws1 nvfp4: written model (nothing to exchange: local runs every T)
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // bf16 ws1 fp8_group128: written model (nothing to exchange: local runs every T)
            {kAllTokens, kAllTokens, kAllTokens, kAllTokens, kAllTokens},  // bf16 ws1 fp8_tensor: written model (nothing to exchange: local runs every T)
        },
        {  // bf16 ws2
            {0, 512, 512, 512, 512},  // bf16 ws2 plain: measured: 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.069x, mean 1.001x
            {0, 256, 256, 256, 1024},  // bf16 ws2 nvfp4: measured: 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.135x, mean 1.002x
            {0, 512, 512, 512, 512},  // bf16 ws2 fp8_group128: measured: 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.068x, mean 1.002x
            {0, 512, 512, 512, 512},  // bf16 ws2 fp8_tensor: measured: 1 of 60 points over 1.05x the best program (0 at the target shape), at most 1.060x, mean 1.001x
        },
        {  // bf16 ws4
            {0, 64, 1024, kAllTokens, kAllTokens},  // bf16 ws4 plain: written model
            {0, 64, 1024, kAllTokens, kAllTokens},  // bf16 ws4 nvfp4: written model
            {0, 64, 1024, kAllTokens, kAllTokens},  // bf16 ws4 fp8_group128: written model
            {0, 64, 1024, kAllTokens, kAllTokens},  // bf16 ws4 fp8_tensor: written model
        },
        {  // bf16 ws8
            {0, 16, 2048, kAllTokens, kAllTokens},  // bf16 ws8 plain: written model
            {0, 16, 2048, kAllTokens, kAllTokens},  // bf16 ws8 nvfp4: written model
            {0, 16, 2048, kAllTokens, kAllTokens},  // bf16 ws8 fp8_group128: written model
            {0, 16, 2048, kAllTokens, kAllTokens},  // bf16 ws8 fp8_tensor: written model
        },
        {  // bf16 ws16
            {0, 8, 4096, kAllTokens, kAllTokens},  // bf16 ws16 plain: written model
            {0, 8, 4096, kAllTokens, kAllTokens},  // bf16 ws16 nvfp4: written model
            {0, 8, 4096, kAllTokens, kAllTokens},  // bf16 ws16 fp8_group128: written model
            {0, 8, 4096, kAllTokens, kAllTokens},  // bf16 ws16 fp8_tensor: written model
        },
    },
};
