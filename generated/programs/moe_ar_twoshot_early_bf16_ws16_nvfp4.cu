// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_early_bf16_ws16_nvfp4: two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill the GPU (lower two-shot range)
// dtype bf16, world size 16, output profile nvfp4 (quant="nvfp4"): norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_twoshot_early_bf16_ws16_nvfp4(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 16, moe_ar::Profile::kNvfp4, moe_ar::Regime::kTwoShotEarly, /*shared_prefetch=*/false>(p);
}
