// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/family_table.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Kernel table of family twoshot_pipelined (protocol lamport2, base family twoshot):
//   two-shot with its phases pipelined over token columns, so one column's reads overlap the exchange of the columns before; no self-traffic through its own buffer, every received vector cleared as it is read; the partials' rows come through a ring in shared memory (largest T; world size 2)
// Each entry is a program's kernel symbol; nullptr is a hole, and selection
// runs the fallback family named in the entry's comment instead.
// [dtype: fp16, bf16][world size: 2, 4, 8, 16][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
static const char* const kTwoShotPipelinedKernels[2][4][4] = {
    {  // fp16
        {  // fp16 ws2
            "moe_ar_twoshot_pipelined_fp16_ws2_plain",  // fp16 ws2 plain
            "moe_ar_twoshot_pipelined_fp16_ws2_nvfp4",  // fp16 ws2 nvfp4
            "moe_ar_twoshot_pipelined_fp16_ws2_fp8_group128",  // fp16 ws2 fp8_group128
            "moe_ar_twoshot_pipelined_fp16_ws2_fp8_tensor",  // fp16 ws2 fp8_tensor
        },
        {  // fp16 ws4
            nullptr,  // fp16 ws4 plain hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws4 nvfp4 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws4 fp8_group128 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws4 fp8_tensor hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
        },
        {  // fp16 ws8
            nullptr,  // fp16 ws8 plain hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws8 nvfp4 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws8 fp8_group128 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws8 fp8_tensor hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
        },
        {  // fp16 ws16
            nullptr,  // fp16 ws16 plain hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws16 nvfp4 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws16 fp8_group128 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // fp16 ws16 fp8_tensor hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
        },
    },
    {  // bf16
        {  // bf16 ws2
            "moe_ar_twoshot_pipelined_bf16_ws2_plain",  // bf16 ws2 plain
            "moe_ar_twoshot_pipelined_bf16_ws2_nvfp4",  // bf16 ws2 nvfp4
            "moe_ar_twoshot_pipelined_bf16_ws2_fp8_group128",  // bf16 ws2 fp8_group128
            "moe_ar_twoshot_pipelined_bf16_ws2_fp8_tensor",  // bf16 ws2 fp8_tensor
        },
        {  // bf16 ws4
            nullptr,  // bf16 ws4 plain hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws4 nvfp4 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws4 fp8_group128 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws4 fp8_tensor hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
        },
        {  // bf16 ws8
            nullptr,  // bf16 ws8 plain hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws8 nvfp4 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws8 fp8_group128 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws8 fp8_tensor hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
        },
        {  // bf16 ws16
            nullptr,  // bf16 ws16 plain hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws16 nvfp4 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws16 fp8_group128 hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
            nullptr,  // bf16 ws16 fp8_tensor hole -> twoshot: written for world size 2 (one peer); 4, 8 and 16 have no hardware here to measure it on
        },
    },
};
