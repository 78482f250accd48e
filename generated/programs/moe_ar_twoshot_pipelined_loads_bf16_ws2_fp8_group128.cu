// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_pipelined_loads_bf16_ws2_fp8_group128: twoshot_pipelined with the partials' rows loaded into registers instead of the ring: more blocks a multiprocessor, for the profiles whose norm step is heavy, below the T where the ring takes over (world size 2)
// dtype bf16, world size 2, output profile fp8_group128 (quant="fp8_group128"): norm_out + residual_out + FP8 E4M3 quant_out + float32 scale_out per 128-element token group (row- or column-major, optionally power-of-two)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(72) moe_ar_twoshot_pipelined_loads_bf16_ws2_fp8_group128(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 2, moe_ar::Profile::kFp8Group128, moe_ar::Regime::kTwoShotPipelined, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/true>(p);
}
