// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_bf16_ws2_plain: Lamport two-shot: reduce-scatter to the token's owner, owner adds residual, all-gather residual_out; one block per token row in every phase (large T)
// dtype bf16, world size 2, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(72) moe_ar_twoshot_bf16_ws2_plain(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 2, moe_ar::Profile::kPlain, moe_ar::Regime::kTwoShot, /*shared_prefetch=*/false>(p);
}
