// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_oneshot_fp16_ws16_plain: Lamport one-shot: every rank sends its partial to every peer and reduces all tokens itself (small T)
// dtype fp16, world size 16, output profile plain (quant=None): norm_out + residual_out (input dtype)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_ar_oneshot_fp16_ws16_plain(const moe_ar::Params p) {
  moe_ar::run<__half, 16, moe_ar::Profile::kPlain, moe_ar::Regime::kOneShot, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/true>(p);
}
