// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_fp16_ws2_nvfp4: Lamport two-shot: reduce-scatter to the token's owner, owner adds residual, all-gather residual_out; one block per token row in every phase (large T)
// dtype fp16, world size 2, output profile nvfp4 (quant="nvfp4"): norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(72) moe_ar_twoshot_fp16_ws2_nvfp4(const moe_ar::Params p) {
  moe_ar::run<__half, 2, moe_ar::Profile::kNvfp4, moe_ar::Regime::kTwoShot, /*shared_prefetch=*/false>(p);
}
