// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/family_table.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Kernel table of family local (protocol local, base family local):
//   world size 1, nothing exchanged: each block finalizes whole token rows in fp32, adds the residual, rounds once, then RMSNorm; every load of a row issued before any is used up to 16 tokens, four routes at a time above, the token's indices read first (few T)
// Each entry is a program's kernel symbol; nullptr is a hole, and selection
// runs the fallback family named in the entry's comment instead.
// [dtype: fp16, bf16][world size: 1][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
static const char* const kLocalKernels[2][1][4] = {
    {  // fp16
        {  // fp16 ws1
            "moe_ar_local_fp16_ws1_plain",  // fp16 ws1 plain
            "moe_ar_local_fp16_ws1_nvfp4",  // fp16 ws1 nvfp4
            "moe_ar_local_fp16_ws1_fp8_group128",  // fp16 ws1 fp8_group128
            "moe_ar_local_fp16_ws1_fp8_tensor",  // fp16 ws1 fp8_tensor
        },
    },
    {  // bf16
        {  // bf16 ws1
            "moe_ar_local_bf16_ws1_plain",  // bf16 ws1 plain
            "moe_ar_local_bf16_ws1_nvfp4",  // bf16 ws1 nvfp4
            "moe_ar_local_bf16_ws1_fp8_group128",  // bf16 ws1 fp8_group128
            "moe_ar_local_bf16_ws1_fp8_tensor",  // bf16 ws1 fp8_tensor
        },
    },
};
