// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/selection.h.j2.
// inputs sha256: 71c4ddefdf8c1927b66a1277fd42259b64e333f90575b89dd233018be831162d
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Regime boundaries per cell, {oneshot_max_tokens, early_max_tokens}; source:
// model (generator/tuning.py). Selection for a call with T tokens:
// T <= oneshot_max_tokens: oneshot; T <= early_max_tokens: twoshot_early; else
// twoshot; then the shared-expert variant where the rank has a shared operand;
// a hole falls back to its fallback_family
// [dtype: fp16, bf16][world size: 2, 4, 8][output profile: 110, 111][oneshot_max_tokens, early_max_tokens]
static const int kRegimeBoundaries[2][3][2][2] = {
    {  // fp16
        {  // fp16 ws2
            {64, 512},  // fp16 ws2 o110
            {64, 512},  // fp16 ws2 o111
        },
        {  // fp16 ws4
            {32, 512},  // fp16 ws4 o110
            {32, 512},  // fp16 ws4 o111
        },
        {  // fp16 ws8
            {16, 1024},  // fp16 ws8 o110
            {16, 1024},  // fp16 ws8 o111
        },
    },
    {  // bf16
        {  // bf16 ws2
            {64, 512},  // bf16 ws2 o110
            {64, 512},  // bf16 ws2 o111
        },
        {  // bf16 ws4
            {32, 512},  // bf16 ws4 o110
            {32, 512},  // bf16 ws4 o111
        },
        {  // bf16 ws8
            {16, 1024},  // bf16 ws8 o110
            {16, 1024},  // bf16 ws8 o111
        },
    },
};
