// The MoE finalize of this rank: for a token, routed_scaling_factor * sum over routes k of
// scale[t][k] * allreduce_in[expanded_idx[t][k]], plus the shared expert's row. A route whose row is
// out of range adds nothing and is counted (kBadRows). The exchanges round it to the dtype
// (partial_vector); world size 1 adds the residual to it in fp32 first (partial_f32, local.cuh).
#pragma once
#include "lamport.cuh"
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// The 8 fp32 values of one 16-byte vector's partial, not rounded (world size 1).
struct PartialF32 {
  float x[8];
};

// Phase 1: this rank's partial of one 16-byte vector of token t, rounded once to the dtype (it travels
// as the dtype; a -0.0 as +0.0, lamport.cuh); with kRounded false (partial_f32 below) the same sum in
// fp32, not rounded. One body for both: the other branch is discarded at compile time, so an
// exchange's code is what it was before world size 1 (a split into two functions moved ptxas's choices).
// kRoutes routes at a time: that many independent 16-byte loads in flight. kSharedFirst issues the
// shared expert's load before the routes' (in flight with them, one register vector held longer).
// Neither changes the order of the additions, so not the result's bits. kStreaming: the routes' and
// the shared row's loads evict first (see pipelined_two_shot).
template <typename D, bool kSharedPrefetch, int kRoutes = 4, bool kSharedFirst = false, bool kStreaming = false,
          bool kRounded = true>
__device__ __forceinline__ auto partial_vector(const Params& p, int t, int v, unsigned& bad_rows) {
  const int H = p.hidden, K = p.top_k;
  const auto load = [](const void* in) {
    return kStreaming ? load_streaming(static_cast<const uint4*>(in)) : *static_cast<const uint4*>(in);
  };
  uint4 shared_first = make_uint4(0, 0, 0, 0);
  if (kSharedFirst && p.shared_in != nullptr)
    shared_first = load(static_cast<const D*>(p.shared_in) + (long long)t * H + v * kElemsPerVec);
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  const int* idx = p.expanded_idx + (long long)t * K;
  for (int k0 = 0; k0 < K; k0 += kRoutes) {
    uint4 rows[kRoutes];
    float scale[kRoutes];
#pragma unroll
    for (int j = 0; j < kRoutes; ++j) {
      const int k = k0 + j;
      const int row = k < K ? idx[k] : -1;
      const bool in_range = row >= 0 && row < p.rows;
      if (row >= p.rows) ++bad_rows;
      rows[j] = in_range ? load(static_cast<const D*>(p.allreduce_in) + (long long)row * H + v * kElemsPerVec)
                         : make_uint4(0, 0, 0, 0);
      float s = 0.f;
      if (in_range) {
        if (p.scale_kind == 0) s = 1.f;
        else if (p.scale_kind == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
        else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
      }
      scale[j] = s;
    }
#pragma unroll
    for (int j = 0; j < kRoutes; ++j) {
      float x[8];
      Vec<D>::to_float(rows[j], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(scale[j], x[i], acc[i]);
    }
  }
  float out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = acc[i] * p.routed_scaling_factor;
  if (p.shared_in != nullptr) {
    const D* shared = static_cast<const D*>(p.shared_in) + (long long)t * H + v * kElemsPerVec;
    const uint4 sv = kSharedFirst ? shared_first : kSharedPrefetch ? load_readonly(shared) : load(shared);
    float x[8];
    Vec<D>::to_float(sv, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] += x[i];
  }
  if constexpr (kRounded) {
    return without_sentinel(Vec<D>::from_float(out));
  } else {
    PartialF32 unrounded;
#pragma unroll
    for (int i = 0; i < 8; ++i) unrounded.x[i] = out[i];
    return unrounded;
  }
}

// World size 1: this rank's partial of one 16-byte vector of token t in fp32, not rounded (the same
// loads and the same additions in the same order as partial_vector's).
template <typename D, int kRoutes, bool kSharedFirst, bool kStreaming = false>
__device__ __forceinline__ PartialF32 partial_f32(const Params& p, int t, int v, unsigned& bad_rows) {
  return partial_vector<D, /*kSharedPrefetch=*/false, kRoutes, kSharedFirst, kStreaming, /*kRounded=*/false>(
      p, t, v, bad_rows);
}

}  // namespace moe_ar
