// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/family_table.h.j2.
// inputs sha256: 3124efc405b52556c62dc0b2a9c7b11e3fe80bc06c3d11ef9a1e0da7afff805d
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Kernel table of family twoshot (protocol lamport2, base family twoshot):
//   Lamport two-shot: reduce-scatter to the token's owner, owner adds residual, all-gather residual_out; one block per token row in every phase (large T)
// Each entry is a program's kernel symbol; nullptr is a hole, and selection
// runs the fallback family named in the entry's comment instead.
// [dtype: fp16, bf16][world size: 2, 4, 8][output profile: 110, 111, fp8_group128, fp8_tensor]
static const char* const kTwoShotKernels[2][3][4] = {
    {  // fp16
        {  // fp16 ws2
            "moe_ar_ts_fp16_ws2_o110",  // fp16 ws2 o110
            "moe_ar_ts_fp16_ws2_o111",  // fp16 ws2 o111
            "moe_ar_ts_fp16_ws2_fp8_group128",  // fp16 ws2 fp8_group128
            "moe_ar_ts_fp16_ws2_fp8_tensor",  // fp16 ws2 fp8_tensor
        },
        {  // fp16 ws4
            "moe_ar_ts_fp16_ws4_o110",  // fp16 ws4 o110
            "moe_ar_ts_fp16_ws4_o111",  // fp16 ws4 o111
            "moe_ar_ts_fp16_ws4_fp8_group128",  // fp16 ws4 fp8_group128
            "moe_ar_ts_fp16_ws4_fp8_tensor",  // fp16 ws4 fp8_tensor
        },
        {  // fp16 ws8
            "moe_ar_ts_fp16_ws8_o110",  // fp16 ws8 o110
            "moe_ar_ts_fp16_ws8_o111",  // fp16 ws8 o111
            "moe_ar_ts_fp16_ws8_fp8_group128",  // fp16 ws8 fp8_group128
            "moe_ar_ts_fp16_ws8_fp8_tensor",  // fp16 ws8 fp8_tensor
        },
    },
    {  // bf16
        {  // bf16 ws2
            "moe_ar_ts_bf16_ws2_o110",  // bf16 ws2 o110
            "moe_ar_ts_bf16_ws2_o111",  // bf16 ws2 o111
            "moe_ar_ts_bf16_ws2_fp8_group128",  // bf16 ws2 fp8_group128
            "moe_ar_ts_bf16_ws2_fp8_tensor",  // bf16 ws2 fp8_tensor
        },
        {  // bf16 ws4
            "moe_ar_ts_bf16_ws4_o110",  // bf16 ws4 o110
            "moe_ar_ts_bf16_ws4_o111",  // bf16 ws4 o111
            "moe_ar_ts_bf16_ws4_fp8_group128",  // bf16 ws4 fp8_group128
            "moe_ar_ts_bf16_ws4_fp8_tensor",  // bf16 ws4 fp8_tensor
        },
        {  // bf16 ws8
            "moe_ar_ts_bf16_ws8_o110",  // bf16 ws8 o110
            "moe_ar_ts_bf16_ws8_o111",  // bf16 ws8 o111
            "moe_ar_ts_bf16_ws8_fp8_group128",  // bf16 ws8 fp8_group128
            "moe_ar_ts_bf16_ws8_fp8_tensor",  // bf16 ws8 fp8_tensor
        },
    },
};
