// NVFP4 output: E2M1 values in nibbles with an E4M3 scale byte per 16 elements, the scales in the
// 128x4 swizzled layout. Software E2M1 rounding (sm_90 has no cvt to e2m1), exact to the rule of
// docs/operation.md.
#pragma once
#include <cuda_fp8.h>
#include "params.cuh"
#include "shape.cuh"
#include "vector.cuh"

namespace moe_ar {

// Two codings of the rule (moe_ar_tools/reference/quant.py: count the midpoints |q| lies above, ties to the even
// code, saturate at 6, keep the sign bit; a NaN has code 0). tests/test_gpu_correctness.py checks both
// against the rule for all 2^32 floats; quantize_vector_nvfp4 says which runs where.
//
// e2m1_code: one value, with compares and selects (the pipelined two-shot's: bench_results/nvfp4_epilogue/).
// The magnitude of a >= 1 is 2 * exponent + the first mantissa bit, after rounding the mantissa to that
// bit, to nearest even, by an integer add on the float's bits (1.0 -> 2, 6.0 and above -> 7); below 1 it
// is 2a rounded to an integer (0, 1 or 2), to nearest even: the one rounding of 2a + 2^23 leaves that
// integer in the low mantissa bits. NaN: 0 (both compares are false). Branch-free on purpose: lanes of
// a warp take different codes.
__device__ __forceinline__ unsigned e2m1_magnitude_code(float a) {
  const unsigned bits = __float_as_uint(a);
  const unsigned exponent_and_bit = (bits + 0x1FFFFFu + ((bits >> 22) & 1u)) >> 22;  // 1.0 -> 254
  const unsigned from_one = min(exponent_and_bit - 252u, 7u);
  const unsigned below_one = __float_as_uint(__fmaf_rn(a, 2.f, 8388608.f)) - 0x4B000000u;
  return a >= 1.f ? from_one : (a < 1.f ? below_one : 0u);
}
__device__ __forceinline__ unsigned e2m1_code(float q) {
  return (signbit(q) ? 8u : 0u) | e2m1_magnitude_code(fabsf(q));
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned selector) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}
// e2m1x8: eight values, q[i] to nibble i, in 8 instructions a value where e2m1_code and its placement
// take about 16 (the one-shot's: its NVFP4 epilogue is issue-bound, bench_results/oneshot/).
//  * c = min(max(|q|, 0), 6): a NaN becomes 0 (fmaxf returns the other operand), and everything from
//    6 up becomes 6, whose code 7 it has.
//  * The grid step is 1/2 below 2, 1 below 4, 2 above: with 2^k the exponent of max(c, 1) (k = 0, 1,
//    2), m = 2^(1-k) is its inverse, and the code is 2k + rint(c * m), ties to even. m's exponent field
//    is the complement of max(c, 1)'s (255 - e for 8 bits). The rint is the one rounding of c * m + 2^23
//    (c * m is exact): r, the sum's bits, is 2^23's bits + rint(c * m), and m's bits shifted down by 22
//    are 2 * (255 - e) = 256 - 2k. Both are summed into the word at nibble i as they are (a shift-add
//    each); the constants come off all eight nibbles at once at the end (the sums wrap, the nibbles
//    do not carry).
//  * The sign bits: prmt copies the sign of a chosen byte over a whole byte (selector nibble 8 + byte),
//    so three prmts gather the signs of q0, q2, q4, q6 as bytes 0x00 / 0xFF, three more those of the
//    odd ones, and two masks put them at bits 8j + 3 and 8j + 7.
__device__ __forceinline__ unsigned e2m1x8(const float (&q)[8]) {
  unsigned rints = 0, steps = 0;  // sums of r << 4i and of (m >> 22) << 4i
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float c = fminf(fmaxf(fabsf(q[i]), 0.f), 6.f);
    const unsigned m = ~__float_as_uint(fmaxf(c, 1.f)) & 0x7F800000u;
    rints += __float_as_uint(__fmaf_rn(c, __uint_as_float(m), 8388608.f)) << (4 * i);
    steps += 4 * i <= 22 ? m >> (22 - 4 * i) : m << (4 * i - 22);  // m's low 23 bits are 0
  }
  // code = (r - 2^23's bits) + (256 - (m >> 22)) at every nibble
  const unsigned codes = rints - steps + (256u - 0x4B000000u) * 0x11111111u;
  const unsigned b[8] = {__float_as_uint(q[0]), __float_as_uint(q[1]), __float_as_uint(q[2]), __float_as_uint(q[3]),
                         __float_as_uint(q[4]), __float_as_uint(q[5]), __float_as_uint(q[6]), __float_as_uint(q[7])};
  // selector nibble n: the byte of the result at n; 0xB = sign of byte 3 of a, 0xF = of byte 3 of b
  const unsigned even = prmt(prmt(b[0], b[2], 0x00FBu), prmt(b[4], b[6], 0xFB00u), 0x7610u);
  const unsigned odd = prmt(prmt(b[1], b[3], 0x00FBu), prmt(b[5], b[7], 0xFB00u), 0x7610u);
  return codes | (even & 0x08080808u) | (odd & 0x80808080u);
}
// Byte offset of scale (row m, scale column k) in the 128x4 swizzled layout: the row's part plus the
// column's. The quantization takes the row's part once a row, not in every round
// (bench_results/nvfp4_epilogue/).
__device__ __forceinline__ long long swizzled_scale_row(int m, int num_k_tiles) {
  return (long long)(m / 128) * (num_k_tiles * 512) + (m % 32) * 16 + ((m % 128) / 32) * 4;
}
__device__ __forceinline__ int swizzled_scale_column(int k) { return (k / 4) * 512 + (k % 4); }
__device__ __forceinline__ long long swizzled_scale_offset(int m, int k, int num_k_tiles) {
  return swizzled_scale_row(m, num_k_tiles) + swizzled_scale_column(k);
}

// 1 / (float(sf8) / gs) for every scale byte sf8 (0 for sf8 = 0), computed once per block with the
// two correctly rounded divisions of the rule, so that a lookup gives the bits the rule does per block
// of 16 elements. All 256 bytes: a negative or NaN global scale still follows the rule.
constexpr int kE4m3Codes = 256;
__device__ __forceinline__ float* nvfp4_reciprocals() {
  __shared__ float table[kE4m3Codes];
  return table;
}
// Filled before the first row's epilogue; the barriers of that row's sum of squares publish it before any lookup.
// A byte with the sign bit (b + 128) holds the negated entry of b: both divisions are exact to the sign,
// 1 / (-v / gs) = -(1 / (v / gs)), -0 (b = 128) included; so a thread computes a pair, and a block of
// 224 threads fills the table in one round (on the one-shot's critical path).
// A NaN entry (0x7F, 0xFF) may differ in sign only, which no product shows (x * NaN is the one NaN).
__device__ __forceinline__ void fill_nvfp4_reciprocals(const Params& p) {
  float* table = nvfp4_reciprocals();
  const float gs = *p.quant_scale;
  for (int b = threadIdx.x; b < kE4m3Codes / 2; b += blockDim.x) {
    const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
    const float reciprocal = __fdiv_rn(1.0f, __fdiv_rn(v, gs));
    table[b] = b != 0 ? reciprocal : 0.0f;  // the rule compares the byte: only byte 0 gives 0
    table[b + kE4m3Codes / 2] = -reciprocal;
  }
}

// The E4M3 scale byte of a 16-element block, e4m3(gs * amax / 6) saturating, from x = gs * amax. The
// division as multiply-adds: x * RN(1/6), corrected, is the correctly rounded x / 6 wherever that is
// zero (sign included), normal, infinite or NaN; a quotient below the normal range may differ in its
// last bits but not in sign, and converts to the same byte, a signed zero (E4M3 stops at 2^-9). tests/
// test_gpu_correctness.py checks the byte against the one from __fdiv_rn for all 2^32 inputs.
__device__ __forceinline__ __nv_fp8_storage_t nvfp4_scale_byte(float x) {
  constexpr float kSixth = 1.0f / 6.0f;
  const float q = __fmul_rn(x, kSixth);
  const float sf = isinf(q) ? q : corrected_quotient(x, 6.0f, kSixth, q);  // inf: the remainder is NaN
  return __nv_cvt_float_to_fp8(sf, __NV_SATFINITE, __NV_E4M3);
}

// NVFP4 of norm_out vector v of row t, given its 16-element block's amax and the global scale gs.
// Two codings of the same bytes: kFewestInstructions, the scale byte by multiply-adds and the nibbles
// by e2m1x8 (every program but one: NVFP4 epilogues are issue-bound); otherwise the division,
// e2m1_code per element and the dtype's paired conversion, kept for the pipelined two-shot with
// register loads, which spilled more with the other coding at its register cap and ran slower. The
// one with the row ring has the registers and takes the fewest instructions. bench_results/nvfp4_epilogue/.
template <typename D, bool kFewestInstructions, bool kStreamingStores>
__device__ __forceinline__ void quantize_vector_nvfp4(unsigned* quant_row, unsigned char* scale_row, int v, uint4 normed,
                                                      float amax, float gs) {
  const __nv_fp8_storage_t sf8 =
      kFewestInstructions ? nvfp4_scale_byte(__fmul_rn(gs, amax))
                          : __nv_cvt_float_to_fp8(__fdiv_rn(__fmul_rn(gs, amax), 6.0f), __NV_SATFINITE, __NV_E4M3);
  const float scale = nvfp4_reciprocals()[sf8];  // = sf8 != 0 ? 1 / (float(sf8) / gs) : 0
  float q[8];
  if constexpr (kFewestInstructions) Vec<D>::to_float(normed, q);
  else Vec<D>::to_float_paired(normed, q);
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = __fmul_rn(q[i], scale);
  unsigned packed = 0;
  if constexpr (kFewestInstructions) {
    packed = e2m1x8(q);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) packed |= e2m1_code(q[i]) << (4 * i);
  }
  if constexpr (kStreamingStores) __stcs(quant_row + v, packed);
  else quant_row[v] = packed;
  if ((v & 1) == 0) scale_row[swizzled_scale_column(v / 2)] = sf8;
}

// Quantize this thread's norm_out vectors of row t (one per round, in the dtype). The thread holding
// vector v ^ 1 holds the other half of each 16-element block. Two schedules of the same arithmetic:
//   kOverlapRounds: every step of all rounds before the next step, so the rounds' dependent chains
//     (amax, shuffle, a division, a table lookup) overlap: faster in the pipelined two-shots, which
//     run at a register cap anyway (kFewestInstructions: see quantize_vector_nvfp4; the other
//     schedule always takes the fewest);
//   otherwise one round after another: fewer registers, so the uncapped one-shot holds twice the
//     blocks a multiprocessor.
// Each form is kept as it was measured: at a register cap ptxas places its spills differently after
// small changes of the source (bench_results/quant_rounds/).
template <typename D, bool kOverlapRounds, bool kFewestInstructions, bool kStreamingStores>
__device__ __forceinline__ void quantize_row_nvfp4(const Params& p, int t, const uint4 (&normed)[kMaxVecPerThread],
                                                   float gs, RowPlace place = block_row_place()) {
  const int H = row_hidden(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p), num_k_tiles = (H + 63) / 64;
  unsigned* quant_row = reinterpret_cast<unsigned*>(static_cast<unsigned char*>(p.quant_out) + (long long)t * (H / 2));
  unsigned char* scale_row = static_cast<unsigned char*>(p.scale_out) + swizzled_scale_row(t, num_k_tiles);
  if constexpr (kOverlapRounds) {
    float amax[kMaxVecPerThread];
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) amax[r] = amax_of<D, true>(normed[r]);  // 0 for vectors past the row
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r)  // every lane shuffles: vpt is the same for the block
      if (r < vpt) amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 1));
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * place.threads + place.thread;
      if (r >= vpt || v >= nvec) continue;
      quantize_vector_nvfp4<D, kFewestInstructions, kStreamingStores>(quant_row, scale_row, v, normed[r], amax[r], gs);
    }
  } else {
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      if (r >= vpt) break;  // the same for the whole block: every lane below shuffles
      const float own_amax = amax_of<D>(normed[r]);  // 0 for vectors past the row
      const float amax = fmaxf(own_amax, __shfl_xor_sync(0xffffffffu, own_amax, 1));
      const int v = r * place.threads + place.thread;
      if (v >= nvec) continue;
      quantize_vector_nvfp4<D, /*kFewestInstructions=*/true, kStreamingStores>(quant_row, scale_row, v, normed[r], amax,
                                                                               gs);
    }
  }
}

// The padding rows T..roundup(T, 128)-1 all lie in the last 128-row tile, which is one 512-byte
// block per group of 4 scale columns: 16-byte chunk j of a block holds rows j, 32 + j, 64 + j and
// 96 + j of the tile, a 4-byte word each. The whole grid zeroes the padding rows' words, a chunk a
// thread, consecutive threads on consecutive chunks (at small T the grid is a few blocks, and a row
// per block was the critical path: bench_results/nvfp4_epilogue/).
__device__ __forceinline__ void zero_scale_padding_rows(const Params& p) {
  const int T = p.tokens, first_padding = T % 128;  // rows of the last tile from here on are padding
  if (first_padding == 0) return;
  const int groups = (p.hidden / 16 + 3) / 4, num_k_tiles = (p.hidden + 63) / 64;
  unsigned* tile_words = reinterpret_cast<unsigned*>(static_cast<unsigned char*>(p.scale_out) +
                                                     (long long)(T / 128) * (num_k_tiles * 512));
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < groups * 32; c += gridDim.x * blockDim.x) {
    const int j = c % 32;
#pragma unroll
    for (int k = 0; k < 4; ++k)  // scale_out is only 4-byte aligned: four word stores, not one of 16 bytes
      if (k * 32 + j >= first_padding) tile_words[4 * c + k] = 0;
  }
}
// The scale padding: the padding rows, and the columns past H / 16 of rows 0..T-1 (only where H is not
// a multiple of 64). Once a call, by the whole grid, before the exchange: done per row, inside the row
// epilogue, it took registers the epilogue needs (bench_results/quant_rounds/).
__device__ __forceinline__ void zero_scale_padding(const Params& p) {
  zero_scale_padding_rows(p);
  const int cols = p.hidden / 16, padding_cols = (cols + 3) / 4 * 4 - cols, num_k_tiles = (p.hidden + 63) / 64;
  const int n = p.tokens * padding_cols;  // 0 when H % 64 == 0
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    static_cast<unsigned char*>(p.scale_out)[swizzled_scale_offset(i / padding_cols, cols + i % padding_cols,
                                                                   num_k_tiles)] = 0;
}

}  // namespace moe_ar
