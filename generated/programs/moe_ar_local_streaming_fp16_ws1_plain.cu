// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_local_streaming_fp16_ws1_plain: the local program for many tokens: two blocks a multiprocessor, each loading its row a few routes at a time into registers while the other normalizes (large T)
// dtype fp16, world size 1, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"
// The register cap: two blocks a multiprocessor, or the cap the launcher's build for a call shape
// of few routes names (more, smaller blocks a multiprocessor)
#ifdef MOE_AR_FIXED_REGISTER_CAP
#define MOE_AR_STREAMING_BOUND __maxnreg__(MOE_AR_FIXED_REGISTER_CAP)
#else
#define MOE_AR_STREAMING_BOUND __maxnreg__(128)
#endif

extern "C" __global__ void MOE_AR_STREAMING_BOUND moe_ar_local_streaming_fp16_ws1_plain(const moe_ar::Params p) {
  moe_ar::run<__half, 1, moe_ar::Profile::kPlain, moe_ar::Regime::kLocalStreaming, /*shared_prefetch=*/false, /*routes_in_flight=*/2, /*shared_row_first=*/false>(p);
}
