// FP8 E4M3 outputs, per-token-group-128 or per-tensor scale: x / s by the hardware conversion
// (round to nearest even, saturating), exact to the rule of docs/operation.md, with the division done
// by multiply-adds where a GPU test has checked that exhaustively (bench_results/fp8/).
#pragma once
#include <cuda_fp8.h>
#include "params.cuh"
#include "shape.cuh"
#include "vector.cuh"

namespace moe_ar {

constexpr float kE4m3Max = 448.f;       // largest finite FP8 E4M3 value
constexpr int kFp8Group = 128;          // elements per FP8 scale group: 16 vectors
constexpr float kFp8GroupEps = 1e-10f;  // floor of a group's amax
// Params.quant_flags (profile fp8_group128): enum QuantFlag of params.cuh (generator/abi.py)

// 2^ceil(log2(s)) for a normal s > 0, from the bits: a power of two stays, anything else moves up to
// the next exponent. (s >= 1e-10 / 448 is always normal.)
__device__ __forceinline__ float pow2_ceil(float s) {
  unsigned b = __float_as_uint(s);
  if (b & 0x007fffffu) b = (b & 0xff800000u) + 0x00800000u;
  return __uint_as_float(b);
}
// e4m3(clamp(q_i, -448, 448)) of 8 values, as 8 bytes in element order: the conversion saturates
// to +-448 (the clamp) and keeps NaN a NaN, as the rule's clamp does; one instruction per pair.
__device__ __forceinline__ uint2 e4m3x8(const float (&q)[8]) {
  unsigned pair[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)  // q[2i] goes to the low byte
    pair[i] = __nv_cvt_float2_to_fp8x2(make_float2(q[2 * i], q[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
  return make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
}
// The E4M3 bytes of x_i / s for a vector's 8 values, by __fdiv_rn. Out of line: fp8x8 takes this
// path almost never, and inlined in every round it made an FP8 program a tenth longer.
template <typename D>
__device__ __noinline__ uint2 e4m3x8_by_division(uint4 v, float s) {
  float x[8];
  Vec<D>::to_float(v, x);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = __fdiv_rn(x[i], s);
  return e4m3x8(x);
}

// The E4M3 bytes of x_i / s for the 8 values of vector v, each x_i / s the reference's correctly
// rounded float32 division (not a multiplication by a rounded 1 / s); amax >= every |x_i| (NaN aside).
// - s a finite power of two: 1 / s is exact and x * (1 / s) is that quotient.
// - s in [2^-64, 2^64] and amax < s * 2^100: corrected_quotient, 3 instructions a value. No step
//   underflows or overflows where the byte depends on it (|x / s| >= 2^-11; below that every byte is
//   a zero of x's sign), so each case is one with x and s in [1, 2) scaled by powers of two, and
//   tests/test_gpu_correctness.py checks those for every dtype significand of x and every float s in
//   [1, 2), and every dtype value x against every such s byte for byte. FP8-group's vectors take this
//   path unless the group amax is above about 2^73 (s = amax / 448 > 2^64) or infinite; the test
//   also checks its bytes for every pair (x, amax) of dtype values directly.
// - otherwise (a per-tensor scale outside that range, zero, negative or NaN; a vector that could
//   overflow): __fdiv_rn.
template <typename D>
__device__ __forceinline__ uint2 fp8x8(uint4 v, float s, float amax, bool s_is_pow2) {
  float x[8];
  Vec<D>::to_float(v, x);
  if (s_is_pow2 && isfinite(s)) {
    // 2^e -> 2^-e from the exponent bits; every scale here (2^-42 .. 2^120) and its inverse are normal
    const float inverse = __uint_as_float((254u << 23) - __float_as_uint(s));
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __fmul_rn(x[i], inverse);
  } else if (s >= 0x1p-64f && s <= 0x1p64f && amax < s * 0x1p100f) {
    const float y = __frcp_rn(s);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = corrected_quotient(x[i], s, y, __fmul_rn(x[i], y));
  } else {
    return e4m3x8_by_division<D>(v, s);
  }
  return e4m3x8(x);
}

// A group's scale max(amax, 1e-10) / 448, correctly rounded, by corrected_quotient (+inf for an
// infinite amax): tests/test_gpu_correctness.py checks it against __fdiv_rn for every dtype value.
__device__ __forceinline__ float fp8_group_scale(float amax) {
  constexpr float kInverse = 1.0f / kE4m3Max;
  const float m = fmaxf(amax, kFp8GroupEps), q = __fmul_rn(m, kInverse);
  return isinf(q) ? q : corrected_quotient(m, kE4m3Max, kInverse, q);  // inf: the remainder is NaN
}

// Per-token-group FP8 of this thread's norm_out vectors of row t. A group of 128 elements is 16
// consecutive vectors of one round, held by 16 consecutive lanes (a half warp): its amax is a
// 4-step butterfly. Lane 0 of the group writes the float32 scale, row-major [T, H/128] or
// column-major [H/128, roundup(T, 4)]. The values are unpacked twice (for the amax, then for the
// quantization) rather than held as floats in between, and the rounds go one at a time (as NVFP4's):
// fewer registers, more blocks resident.
template <typename D, bool kStreamingStores>
__device__ __forceinline__ void quantize_row_fp8_group(const Params& p, int t, const uint4 (&normed)[kMaxVecPerThread],
                                                       RowPlace place = block_row_place()) {
  const int H = row_hidden(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p), groups = H / kFp8Group;
  const bool column_major = p.quant_flags & kScalesColumnMajor, pow2 = p.quant_flags & kScalesPow2;
  uint2* quant = reinterpret_cast<uint2*>(static_cast<unsigned char*>(p.quant_out) + (long long)t * H);
  // scale of group g: scale_row[g * group_stride]. An int: the offset stays below (H / 128) * (T + 3), and
  // a 64-bit stride cost a block a multiprocessor in registers (bench_results/quant_rounds/).
  const int group_stride = column_major ? (p.tokens + 3) / 4 * 4 : 1;
  float* scale_row = static_cast<float*>(p.scale_out) + (column_major ? (long long)t : (long long)t * groups);
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    if (r >= vpt) break;  // the same for the whole block: every lane below shuffles
    float amax = amax_of<D>(normed[r]);  // 0 for vectors past the row
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int v = r * place.threads + place.thread;
    if (v >= nvec) continue;
    float s = fp8_group_scale(amax);
    if (pow2) s = pow2_ceil(s);
    const uint2 bytes = fp8x8<D>(normed[r], s, amax, pow2);
    if (kStreamingStores) __stcs(quant + v, bytes);
    else quant[v] = bytes;
    if (v % 16 == 0) scale_row[v / 16 * group_stride] = s;
  }
}

// Per-tensor FP8 of this thread's norm_out vectors of row t, with the scale s read from device memory.
template <typename D, bool kStreamingStores>
__device__ __forceinline__ void quantize_row_fp8_tensor(const Params& p, int t, const uint4 (&normed)[kMaxVecPerThread],
                                                        float s, RowPlace place = block_row_place()) {
  const int H = row_hidden(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  uint2* quant = reinterpret_cast<uint2*>(static_cast<unsigned char*>(p.quant_out) + (long long)t * H);
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * place.threads + place.thread;
    if (r >= vpt || v >= nvec) continue;
    const uint2 bytes = fp8x8<D>(normed[r], s, amax_of<D>(normed[r]), false);
    if (kStreamingStores) __stcs(quant + v, bytes);
    else quant[v] = bytes;
  }
}

// Column-major FP8 scales: zero the padding tokens T..roundup(T, 4)-1 of every group.
__device__ __forceinline__ void zero_fp8_scale_padding(const Params& p) {
  const int T = p.tokens, padded_T = (T + 3) / 4 * 4, groups = p.hidden / kFp8Group;
  const int n = (padded_T - T) * groups;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    static_cast<float*>(p.scale_out)[(long long)(i / (padded_T - T)) * padded_T + T + i % (padded_T - T)] = 0.f;
}

}  // namespace moe_ar
