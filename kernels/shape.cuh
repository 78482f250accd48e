// The shape of a call as the row code reads it: the Params fields, or compile-time constants where the
// runtime compiled the program for one shape (world size 1's latency program, dispatch/shape_constants.py
// puts the MOE_AR_FIXED_* defines first in its source). Constants let the compiler drop the checks of
// vectors past the row and routes past top_k: at a few tokens a block runs one warp a scheduler, and
// those instructions are latency (bench_results/world_size_1/shape_constants/).
#pragma once
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

__device__ __forceinline__ int row_hidden(const Params& p) {
#ifdef MOE_AR_FIXED_HIDDEN
  return MOE_AR_FIXED_HIDDEN;
#else
  return p.hidden;
#endif
}
__device__ __forceinline__ int row_top_k(const Params& p) {
#ifdef MOE_AR_FIXED_TOP_K
  return MOE_AR_FIXED_TOP_K;
#else
  return p.top_k;
#endif
}
__device__ __forceinline__ int row_vec_per_thread(const Params& p) {
#ifdef MOE_AR_FIXED_VEC_PER_THREAD
  return MOE_AR_FIXED_VEC_PER_THREAD;
#else
  return p.vec_per_thread;
#endif
}
// 0: no router weights, 1: float32, 2: the dtype (Params.scale_kind)
__device__ __forceinline__ int row_scale_kind(const Params& p) {
#ifdef MOE_AR_FIXED_SCALE_KIND
  return MOE_AR_FIXED_SCALE_KIND;
#else
  return p.scale_kind;
#endif
}

}  // namespace moe_ar
