// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/family_table.h.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
#pragma once

// Kernel table of family twoshot_pipelined_loads (protocol lamport2, base family twoshot_pipelined):
//   twoshot_pipelined with the partials' rows loaded into registers instead of the ring: more blocks a multiprocessor, for the profiles whose norm step is heavy, below the T where the ring takes over (world size 2)
// Each entry is a program's kernel symbol; nullptr is a hole, and selection
// runs the fallback family named in the entry's comment instead.
// [dtype: fp16, bf16][world size: 2, 4, 8, 16][output profile: plain, nvfp4, fp8_group128, fp8_tensor]
static const char* const kTwoShotPipelinedLoadsKernels[2][4][4] = {
    {  // fp16
        {  // fp16 ws2
            nullptr,  // fp16 ws2 plain hole -> twoshot_pipelined: the row ring (twoshot_pipelined) was faster at every measured T (bench_results/pipelined/row_ring/)
            "moe_ar_twoshot_pipelined_loads_fp16_ws2_nvfp4",  // fp16 ws2 nvfp4
            "moe_ar_twoshot_pipelined_loads_fp16_ws2_fp8_group128",  // fp16 ws2 fp8_group128
            nullptr,  // fp16 ws2 fp8_tensor hole -> twoshot_pipelined: the row ring (twoshot_pipelined) was faster at every measured T (bench_results/pipelined/row_ring/)
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
            nullptr,  // bf16 ws2 plain hole -> twoshot_pipelined: the row ring (twoshot_pipelined) was faster at every measured T (bench_results/pipelined/row_ring/)
            "moe_ar_twoshot_pipelined_loads_bf16_ws2_nvfp4",  // bf16 ws2 nvfp4
            "moe_ar_twoshot_pipelined_loads_bf16_ws2_fp8_group128",  // bf16 ws2 fp8_group128
            nullptr,  // bf16 ws2 fp8_tensor hole -> twoshot_pipelined: the row ring (twoshot_pipelined) was faster at every measured T (bench_results/pipelined/row_ring/)
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
