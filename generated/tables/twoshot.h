// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/family_table.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Kernel table of family twoshot (protocol lamport2, base family twoshot):
//   Lamport two-shot: reduce-scatter to the token's owner, owner adds residual, all-gather residual_out; one block per token row in every phase (large T)
// Each entry is a program's kernel symbol; nullptr is a hole, and selection
// runs the fallback family named in the entry's comment instead.
// [dtype: fp16, bf16][world size: 2, 4, 8, 16][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
static const char* const kTwoShotKernels[2][4][4] = {
    {  // fp16
        {  // fp16 ws2
            "moe_ar_twoshot_fp16_ws2_plain",  // fp16 ws2 plain
            "moe_ar_twoshot_fp16_ws2_nvfp4",  // fp16 ws2 nvfp4
            "moe_ar_twoshot_fp16_ws2_fp8_group128",  // fp16 ws2 fp8_group128
            "moe_ar_twoshot_fp16_ws2_fp8_tensor",  // fp16 ws2 fp8_tensor
        },
        {  // fp16 ws4
            "moe_ar_twoshot_fp16_ws4_plain",  // fp16 ws4 plain
            "moe_ar_twoshot_fp16_ws4_nvfp4",  // fp16 ws4 nvfp4
            "moe_ar_twoshot_fp16_ws4_fp8_group128",  // fp16 ws4 fp8_group128
            "moe_ar_twoshot_fp16_ws4_fp8_tensor",  // fp16 ws4 fp8_tensor
        },
        {  // fp16 ws8
            "moe_ar_twoshot_fp16_ws8_plain",  // fp16 ws8 plain
            "moe_ar_twoshot_fp16_ws8_nvfp4",  // fp16 ws8 nvfp4
            "moe_ar_twoshot_fp16_ws8_fp8_group128",  // fp16 ws8 fp8_group128
            "moe_ar_twoshot_fp16_ws8_fp8_tensor",  // fp16 ws8 fp8_tensor
        },
        {  // fp16 ws16
            "moe_ar_twoshot_fp16_ws16_plain",  // fp16 ws16 plain
            "moe_ar_twoshot_fp16_ws16_nvfp4",  // fp16 ws16 nvfp4
            "moe_ar_twoshot_fp16_ws16_fp8_group128",  // fp16 ws16 fp8_group128
            "moe_ar_twoshot_fp16_ws16_fp8_tensor",  // fp16 ws16 fp8_tensor
        },
    },
    {  // bf16
        {  // bf16 ws2
            "moe_ar_twoshot_bf16_ws2_plain",  // bf16 ws2 plain
            "moe_ar_twoshot_bf16_ws2_nvfp4",  // bf16 ws2 nvfp4
            "moe_ar_twoshot_bf16_ws2_fp8_group128",  // bf16 ws2 fp8_group128
            "moe_ar_twoshot_bf16_ws2_fp8_tensor",  // bf16 ws2 fp8_tensor
        },
        {  // bf16 ws4
            "moe_ar_twoshot_bf16_ws4_plain",  // bf16 ws4 plain
            "moe_ar_twoshot_bf16_ws4_nvfp4",  // bf16 ws4 nvfp4
            "moe_ar_twoshot_bf16_ws4_fp8_group128",  // bf16 ws4 fp8_group128
            "moe_ar_twoshot_bf16_ws4_fp8_tensor",  // bf16 ws4 fp8_tensor
        },
        {  // bf16 ws8
            "moe_ar_twoshot_bf16_ws8_plain",  // bf16 ws8 plain
            "moe_ar_twoshot_bf16_ws8_nvfp4",  // bf16 ws8 nvfp4
            "moe_ar_twoshot_bf16_ws8_fp8_group128",  // bf16 ws8 fp8_group128
            "moe_ar_twoshot_bf16_ws8_fp8_tensor",  // bf16 ws8 fp8_tensor
        },
        {  // bf16 ws16
            "moe_ar_twoshot_bf16_ws16_plain",  // bf16 ws16 plain
            "moe_ar_twoshot_bf16_ws16_nvfp4",  // bf16 ws16 nvfp4
            "moe_ar_twoshot_bf16_ws16_fp8_group128",  // bf16 ws16 fp8_group128
            "moe_ar_twoshot_bf16_ws16_fp8_tensor",  // bf16 ws16 fp8_tensor
        },
    },
};
