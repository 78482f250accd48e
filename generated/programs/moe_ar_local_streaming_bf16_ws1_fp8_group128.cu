// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_local_streaming_bf16_ws1_fp8_group128: the local program for many tokens: two blocks a multiprocessor, each loading its row a few routes at a time into registers while the other normalizes (large T)
// dtype bf16, world size 1, output profile fp8_group128 (quant="fp8_group128"): norm_out + residual_out + FP8 E4M3 quant_out + float32 scale_out per 128-element token group (row- or column-major, optionally power-of-two)
#include "moe_finalize_allreduce.cuh"
// The register cap: two blocks a multiprocessor, or the cap the launcher's build for a call shape
// of few routes names (more, smaller blocks a multiprocessor)
#ifdef MOE_AR_FIXED_REGISTER_CAP
#define MOE_AR_STREAMING_BOUND __maxnreg__(MOE_AR_FIXED_REGISTER_CAP)
#else
#define MOE_AR_STREAMING_BOUND __maxnreg__(128)
#endif

extern "C" __global__ void MOE_AR_STREAMING_BOUND moe_ar_local_streaming_bf16_ws1_fp8_group128(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 1, moe_ar::Profile::kFp8Group128, moe_ar::Regime::kLocalStreaming, /*shared_prefetch=*/false, /*routes_in_flight=*/2, /*shared_row_first=*/false>(p);
}
