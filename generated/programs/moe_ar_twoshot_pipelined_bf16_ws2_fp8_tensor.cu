// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_pipelined_bf16_ws2_fp8_tensor: two-shot with its phases pipelined over token columns, so one column's reads overlap the exchange of the columns before; no self-traffic through its own buffer, every received vector cleared as it is read; the partials' rows come through a ring in shared memory (largest T; world size 2)
// dtype bf16, world size 2, output profile fp8_tensor (quant="fp8_tensor"): norm_out + residual_out + FP8 E4M3 quant_out with a per-tensor scale given on the device
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(128) moe_ar_twoshot_pipelined_bf16_ws2_fp8_tensor(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 2, moe_ar::Profile::kFp8Tensor, moe_ar::Regime::kTwoShotPipelined, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/false, /*row_stages=*/3>(p);
}
