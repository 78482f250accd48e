// The poisoned output after a timeout. Every block with a thread that gave up (and any block ending
// after that) writes it over all of its rows, and so does every later kernel of a poisoned workspace
// (kPoisoned, until reset()): queued kernels and CUDA-graph replays after a timeout give NaN, never
// numbers computed from inconsistent buffers.
#pragma once
#include "call.cuh"
#include "fp8.cuh"
#include "lamport.cuh"
#include "nvfp4.cuh"
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// The poisoned output of row t (after a timeout): NaN in norm_out and residual_out, 0x7F in every byte
// of quant_out (for FP8 an E4M3 NaN) and in every NVFP4 scale byte of the row (an E4M3 NaN scale), NaN
// FP8-group scales. Scale padding stays 0.
[[maybe_unused]] constexpr unsigned kPoisonQuantWord = 0x7F7F7F7Fu;  // unused by the local programs (no poison)
template <Profile P>
__device__ __forceinline__ void poison_row(void* norm_out, void* residual_out, void* quant_out, void* scale_out, int t,
                                           int T, int H, int quant_flags) {
  const uint4 nan = make_uint4(kNanWord, kNanWord, kNanWord, kNanWord);
  const int nvec = H / kElemsPerVec;
  uint4* norm_row_out = reinterpret_cast<uint4*>(static_cast<unsigned char*>(norm_out) + (long long)t * H * 2);
  uint4* residual_row_out = reinterpret_cast<uint4*>(static_cast<unsigned char*>(residual_out) + (long long)t * H * 2);
  for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
    norm_row_out[v] = nan;
    residual_row_out[v] = nan;
  }
  if (P == Profile::kNvfp4) {  // quant_out rows are H / 2 bytes, 4-byte aligned
    unsigned* q = reinterpret_cast<unsigned*>(static_cast<unsigned char*>(quant_out) + (long long)t * (H / 2));
    for (int i = threadIdx.x; i < H / 8; i += blockDim.x) q[i] = kPoisonQuantWord;
    const int num_k_tiles = (H + 63) / 64;
    unsigned char* scale_row = static_cast<unsigned char*>(scale_out) + swizzled_scale_row(t, num_k_tiles);
    for (int k = threadIdx.x; k < H / 16; k += blockDim.x) scale_row[swizzled_scale_column(k)] = 0x7F;
  }
  if (P == Profile::kFp8Group128 || P == Profile::kFp8Tensor) {  // rows of H bytes, 16-byte aligned
    uint4* q = reinterpret_cast<uint4*>(static_cast<unsigned char*>(quant_out) + (long long)t * H);
    for (int i = threadIdx.x; i < H / 16; i += blockDim.x)
      q[i] = make_uint4(kPoisonQuantWord, kPoisonQuantWord, kPoisonQuantWord, kPoisonQuantWord);
  }
  if (P == Profile::kFp8Group128) {
    const int groups = H / kFp8Group;
    const bool column_major = quant_flags & kScalesColumnMajor;
    float* s = static_cast<float*>(scale_out);
    for (int g = threadIdx.x; g < groups; g += blockDim.x)
      s[column_major ? (long long)g * ((T + 3) / 4 * 4) + t : (long long)t * groups + g] = __uint_as_float(0x7FFFFFFFu);
  }
}

// The poisoned output of every row this block reduces and normalizes: rows blockIdx.x, + gridDim.x, ...;
// in the pipelined two-shot (columns) the rows of its columns, token j of each of the two ranks. Over the
// grid: every row. Out of line, with scalars: it never runs in a healthy call.
template <Profile P>
__device__ __noinline__ void poison_block_rows(void* norm_out, void* residual_out, void* quant_out, void* scale_out,
                                               int T, int H, int quant_flags, bool columns) {
  const int C = columns ? (T + 1) / 2 : T;  // tokens a rank owns (layout_of, world size 2)
  for (int j = blockIdx.x; j < C; j += gridDim.x)
    for (int t = j; t < T; t += C) poison_row<P>(norm_out, residual_out, quant_out, scale_out, t, T, H, quant_flags);
}
template <Profile P, Regime R>
__device__ __forceinline__ void poison_block_rows(const Params& p) {
  poison_block_rows<P>(p.norm_out, p.residual_out, p.quant_out, p.scale_out, p.tokens, p.hidden, p.quant_flags,
                       R == Regime::kTwoShotPipelined);
}

}  // namespace moe_ar
