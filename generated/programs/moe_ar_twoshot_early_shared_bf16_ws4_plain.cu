// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_early_shared_bf16_ws4_plain: twoshot_early + shared-expert row prefetched into L2 before the exchange and loaded read-only
// dtype bf16, world size 4, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_twoshot_early_shared_bf16_ws4_plain(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 4, moe_ar::Profile::kPlain, moe_ar::Regime::kTwoShotEarly, /*shared_prefetch=*/true>(p);
}
