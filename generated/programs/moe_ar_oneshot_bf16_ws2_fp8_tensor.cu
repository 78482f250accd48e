// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_oneshot_bf16_ws2_fp8_tensor: Lamport one-shot: every rank sends its partial to every peer and reduces all tokens itself (small T)
// dtype bf16, world size 2, output profile fp8_tensor (quant="fp8_tensor"): norm_out + residual_out + FP8 E4M3 quant_out with a per-tensor scale given on the device
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_oneshot_bf16_ws2_fp8_tensor(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 2, moe_ar::Profile::kFp8Tensor, moe_ar::Regime::kOneShot, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/true>(p);
}
