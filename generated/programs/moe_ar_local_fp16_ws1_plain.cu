// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_local_fp16_ws1_plain: world size 1, nothing exchanged: each block finalizes whole token rows in fp32, adds the residual, rounds once, then RMSNorm; every load of a row issued before any is used up to 16 tokens, four routes at a time above, the token's indices read first (few T)
// dtype fp16, world size 1, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"
// The one-block kernel's bound: one block a multiprocessor at least (128 registers a thread, a row's
// loads before its first addition) where the launcher's build for a call shape of small rows names it
#ifdef MOE_AR_FIXED_MIN_BLOCKS
#define MOE_AR_ONE_BLOCK_BOUND __launch_bounds__(512, MOE_AR_FIXED_MIN_BLOCKS)
#else
#define MOE_AR_ONE_BLOCK_BOUND __launch_bounds__(512)
#endif

extern "C" __global__ void MOE_AR_ONE_BLOCK_BOUND moe_ar_local_fp16_ws1_plain(const moe_ar::Params p) {
  moe_ar::run<__half, 1, moe_ar::Profile::kPlain, moe_ar::Regime::kLocal, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/true>(p);
}
// The same row over a cluster of blocks a token (few tokens; the launcher picks it)
extern "C" __global__ void __launch_bounds__(512, 1) moe_ar_local_fp16_ws1_plain_cluster(const moe_ar::Params p) {
  moe_ar::run_local_cluster<__half, moe_ar::Profile::kPlain>(p);
}
