// The MoE finalize of this rank: for a token, routed_scaling_factor * sum over routes k of
// scale[t][k] * allreduce_in[expanded_idx[t][k]], plus the shared expert's row. A route whose row is
// out of range adds nothing and is counted (kBadRows). The exchanges round it to the dtype
// (partial_vector); world size 1 adds the residual to it in fp32 first (local.cuh).
#pragma once
#include "lamport.cuh"
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// This rank's partial of one 16-byte vector of token t, in fp32 (out), not rounded: the routes'
// weighted sum in route order, times routed_scaling_factor, plus the shared expert's row.
// kRoutes routes at a time: that many independent 16-byte loads in flight. kSharedFirst issues the
// shared expert's load before the routes' (in flight with them, one register vector held longer).
// Neither changes the order of the additions, so not the result's bits. kStreaming: the routes' and
// the shared row's loads evict first (see pipelined_two_shot).
template <typename D, bool kSharedPrefetch, int kRoutes = 4, bool kSharedFirst = false, bool kStreaming = false>
__device__ __forceinline__ void partial_f32(const Params& p, int t, int v, unsigned& bad_rows, float (&out)[8]) {
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
}

// Phase 1 of the exchanges: this rank's partial of one 16-byte vector, rounded once to the dtype (it
// travels as the dtype; a -0.0 as +0.0, lamport.cuh).
template <typename D, bool kSharedPrefetch, int kRoutes = 4, bool kSharedFirst = false, bool kStreaming = false>
__device__ __forceinline__ uint4 partial_vector(const Params& p, int t, int v, unsigned& bad_rows) {
  float out[8];
  partial_f32<D, kSharedPrefetch, kRoutes, kSharedFirst, kStreaming>(p, t, v, bad_rows, out);
  return without_sentinel(Vec<D>::from_float(out));
}

}  // namespace moe_ar
