// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/family_table.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Kernel table of family local_streaming (protocol local, base family local):
//   the local program for many tokens: two blocks a multiprocessor, each loading its row a few routes at a time while the other normalizes (FP8 group-128: the rows come into a ring in shared memory by bulk copies) (large T)
// Each entry is a program's kernel symbol; nullptr is a hole, and selection
// runs the fallback family named in the entry's comment instead.
// [dtype: fp16, bf16][world size: 1][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
static const char* const kLocalStreamingKernels[2][1][4] = {
    {  // fp16
        {  // fp16 ws1
            "moe_ar_local_streaming_fp16_ws1_plain",  // fp16 ws1 plain
            "moe_ar_local_streaming_fp16_ws1_nvfp4",  // fp16 ws1 nvfp4
            "moe_ar_local_streaming_fp16_ws1_fp8_group128",  // fp16 ws1 fp8_group128
            "moe_ar_local_streaming_fp16_ws1_fp8_tensor",  // fp16 ws1 fp8_tensor
        },
    },
    {  // bf16
        {  // bf16 ws1
            "moe_ar_local_streaming_bf16_ws1_plain",  // bf16 ws1 plain
            "moe_ar_local_streaming_bf16_ws1_nvfp4",  // bf16 ws1 nvfp4
            "moe_ar_local_streaming_bf16_ws1_fp8_group128",  // bf16 ws1 fp8_group128
            "moe_ar_local_streaming_bf16_ws1_fp8_tensor",  // bf16 ws1 fp8_tensor
        },
    },
};
