// The epilogue of a token row: RMSNorm of residual_out into norm_out, then the quantized output of
// the profile (nvfp4.cuh, fp8.cuh).
#pragma once
#include "block_sum.cuh"
#include "call.cuh"
#include "fp8.cuh"
#include "nvfp4.cuh"
#include "params.cuh"
#include "shape.cuh"
#include "vector.cuh"

namespace moe_ar {

// Epilogue of one token row: residual_out values (in the dtype, held in registers)
// -> RMSNorm -> norm_out (+ NVFP4 or FP8). The whole block calls it for the same row.
// kOverlapQuantRounds, kFewestQuantInstructions: see quantize_row_nvfp4. kStreamingStores: the
// stores of norm_out and of the quantized row evict first (see pipelined_two_shot). kOneOrderSum: the
// sum of squares in one order whatever the row's split (row_sum_of_squares; world size 1's latency
// program, whose cluster and one-block layouts split a row differently); else block_sum, whose
// order follows the split.
// kClusterRow: the row is held by the blocks of a cluster (world size 1's cluster layout, `place` in
// it), which sum its squares together (cluster_row_sum_of_squares, one order).
template <typename D, Profile P, bool kOverlapQuantRounds = false, bool kFewestQuantInstructions = true,
          bool kStreamingStores = false, bool kClusterRow = false, bool kOneOrderSum = kClusterRow>
__device__ __forceinline__ void norm_row(const Params& p, int t, const uint4 (&res)[kMaxVecPerThread],
                                         RowPlace place = block_row_place()) {
  static_assert(kOneOrderSum || !kClusterRow, "the cluster layout sums in one order");
  const int H = row_hidden(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  // The global scale of the quantized output, like gamma read before the block reduction, which hides
  // its latency (read per NVFP4 vector, it was on each vector's dependent chain).
  const float quant_scale = P == Profile::kFp8Tensor || P == Profile::kNvfp4 ? __ldg(p.quant_scale) : 0.f;
  uint4 gamma[kMaxVecPerThread];  // loaded before the block reduction, which hides their latency
  // the squares of the thread's vector r (one order), or of all its vectors in one sum (block_sum)
  constexpr int kN = kOneOrderSum ? kRowSumValues : 1;
  float sq[kN];
#pragma unroll
  for (int r = 0; r < kN; ++r) sq[r] = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * place.threads + place.thread;
    gamma[r] = make_uint4(0, 0, 0, 0);
    if (r < vpt && v < nvec && (!kOneOrderSum || r < kN)) {
      gamma[r] = load_readonly(static_cast<const D*>(p.norm_weight) + v * kElemsPerVec);
      float x[8];
      Vec<D>::to_float(res[r], x);
      float& s = sq[kOneOrderSum ? r : 0];
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(x[i], x[i], s);
    }
  }
  float total;
  if constexpr (kClusterRow) total = cluster_row_sum_of_squares<kN>(sq, place, nvec);
  else if constexpr (kOneOrderSum) total = row_sum_of_squares<kN>(sq, place, nvec);
  else total = block_sum(sq[0]);
  const float rms = rsqrtf(__fdiv_rn(total, (float)H) + p.eps);
  D* norm_out = static_cast<D*>(p.norm_out) + (long long)t * H;
  uint4 normed[kMaxVecPerThread];  // norm_out in the dtype: what the quantized outputs encode
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * place.threads + place.thread;
    normed[r] = make_uint4(0, 0, 0, 0);
    if (r >= vpt || v >= nvec) continue;
    float g[8], x[8], y[8];
    Vec<D>::to_float(gamma[r], g);
    Vec<D>::to_float(res[r], x);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(__fmul_rn(x[i], rms), g[i] + p.weight_bias);
    normed[r] = Vec<D>::from_float(y);
    if (kStreamingStores) __stcs(reinterpret_cast<uint4*>(norm_out) + v, normed[r]);
    else reinterpret_cast<uint4*>(norm_out)[v] = normed[r];
  }
  if (P == Profile::kNvfp4)
    quantize_row_nvfp4<D, kOverlapQuantRounds, kFewestQuantInstructions, kStreamingStores>(p, t, normed, quant_scale,
                                                                                           place);
  if (P == Profile::kFp8Group128) quantize_row_fp8_group<D, kStreamingStores>(p, t, normed, place);
  if (P == Profile::kFp8Tensor) quantize_row_fp8_tensor<D, kStreamingStores>(p, t, normed, quant_scale, place);
}

}  // namespace moe_ar
