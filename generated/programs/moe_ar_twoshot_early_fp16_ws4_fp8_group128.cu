// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_early_fp16_ws4_fp8_group128: two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill the GPU (lower two-shot range)
// dtype fp16, world size 4, output profile fp8_group128 (quant="fp8_group128"): norm_out + residual_out + FP8 E4M3 quant_out + float32 scale_out per 128-element token group (row- or column-major, optionally power-of-two)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_twoshot_early_fp16_ws4_fp8_group128(const moe_ar::Params p) {
  moe_ar::run<__half, 4, moe_ar::Profile::kFp8Group128, moe_ar::Regime::kTwoShotEarly, /*shared_prefetch=*/false>(p);
}
