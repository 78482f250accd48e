// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_early_bf16_ws16_plain: two-shot with the reduce-scatter phases split into row slices so few owned tokens still fill the GPU (lower two-shot range)
// dtype bf16, world size 16, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_twoshot_early_bf16_ws16_plain(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 16, moe_ar::Profile::kPlain, moe_ar::Regime::kTwoShotEarly, /*shared_prefetch=*/false>(p);
}
