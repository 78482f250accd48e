// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_pipelined_loads_fp16_ws2_nvfp4: twoshot_pipelined with the partials' rows loaded into registers instead of the ring: more blocks a multiprocessor, for the profiles whose norm step is heavy, below the T where the ring takes over (world size 2)
// dtype fp16, world size 2, output profile nvfp4 (quant="nvfp4"): norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(72) moe_ar_twoshot_pipelined_loads_fp16_ws2_nvfp4(const moe_ar::Params p) {
  moe_ar::run<__half, 2, moe_ar::Profile::kNvfp4, moe_ar::Regime::kTwoShotPipelined, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/true>(p);
}
