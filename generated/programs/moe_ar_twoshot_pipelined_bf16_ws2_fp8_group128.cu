// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_pipelined_bf16_ws2_fp8_group128: two-shot with its phases pipelined over token columns, so one column's reads overlap the exchange of the columns before; no self-traffic through its own buffer, every received vector cleared as it is read; the partials' rows come through a ring in shared memory (largest T; world size 2)
// dtype bf16, world size 2, output profile fp8_group128 (quant="fp8_group128"): norm_out + residual_out + FP8 E4M3 quant_out + float32 scale_out per 128-element token group (row- or column-major, optionally power-of-two)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(128) moe_ar_twoshot_pipelined_bf16_ws2_fp8_group128(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 2, moe_ar::Profile::kFp8Group128, moe_ar::Regime::kTwoShotPipelined, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/false, /*row_stages=*/3>(p);
}
