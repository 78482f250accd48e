// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_early_fp16_ws4_plain: two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill the GPU (lower two-shot range)
// dtype fp16, world size 4, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_twoshot_early_fp16_ws4_plain(const moe_ar::Params p) {
  moe_ar::run<__half, 4, moe_ar::Profile::kPlain, moe_ar::Regime::kTwoShotEarly, /*shared_prefetch=*/false>(p);
}
