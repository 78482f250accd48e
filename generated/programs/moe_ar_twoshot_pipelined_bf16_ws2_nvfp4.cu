// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/program.cu.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// moe_ar_twoshot_pipelined_bf16_ws2_nvfp4: two-shot with its phases pipelined over token columns, so one column's reads overlap the exchange of the columns before; no self-traffic through its own buffer, every received vector cleared as it is read; the partials' rows come through a ring in shared memory (largest T; world size 2)
// dtype bf16, world size 2, output profile nvfp4 (quant="nvfp4"): norm_out + residual_out + NVFP4 quant_out/scale_out (128x4 swizzled E4M3 scales)
#include "moe_finalize_allreduce.cuh"

extern "C" __global__ void __maxnreg__(128) moe_ar_twoshot_pipelined_bf16_ws2_nvfp4(const moe_ar::Params p) {
  moe_ar::run<__nv_bfloat16, 2, moe_ar::Profile::kNvfp4, moe_ar::Regime::kTwoShotPipelined, /*shared_prefetch=*/false, /*routes_in_flight=*/4, /*shared_row_first=*/false, /*row_stages=*/3>(p);
}
