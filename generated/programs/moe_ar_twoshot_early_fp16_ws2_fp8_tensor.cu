// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_early_fp16_ws2_fp8_tensor: two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill the GPU (lower two-shot range)
// dtype fp16, world size 2, output profile fp8_tensor (quant="fp8_tensor"): norm_out + residual_out + FP8 E4M3 quant_out with a per-tensor scale given on the device
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(72) moe_ar_twoshot_early_fp16_ws2_fp8_tensor(const moe_ar::Params p) {
  moe_ar::run<__half, 2, moe_ar::Profile::kFp8Tensor, moe_ar::Regime::kTwoShotEarly, /*shared_prefetch=*/false>(p);
}
