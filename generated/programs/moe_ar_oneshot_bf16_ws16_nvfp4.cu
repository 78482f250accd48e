// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_oneshot_bf16_ws16_nvfp4: Lamport one-shot: every rank sends its partial to every peer and reduces all tokens itself (small T)
// dtype bf16, world size 16, output profile nvfp4 (quant="nvfp4"): norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_oneshot_bf16_ws16_nvfp4(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 16, moe_ar::Profile::kNvfp4, moe_ar::Regime::kOneShot, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/true>(p);
}
