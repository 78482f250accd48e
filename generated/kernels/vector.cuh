// 16-byte vectors of eight fp16 or bf16 elements: conversion to and from float, the loads that read
// them, and two helpers of the quantized outputs (a vector's max |x|, a division by multiply-adds).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe_ar {

constexpr int kElemsPerVec = 8;  // a 16-byte vector holds 8 elements of a 2-byte dtype

// Vec<D>: 8 elements <-> 8 floats; scalar() reads one element.
// The shared-memory address of a generic pointer into this block's shared memory.
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Where a thread sits in a token row: its vector r is r * threads + thread. A block holds a whole row
// (block_row_place); world size 1's cluster layout spreads one row over the blocks of a cluster.
struct RowPlace {
  int thread, threads;
};
// The threads holding a row: the block's, or a constant where the program was compiled for one shape
// (MOE_AR_FIXED_ROW_THREADS, see shape.cuh; a cluster's blocks hold that many together).
__device__ __forceinline__ int row_threads() {
#ifdef MOE_AR_FIXED_ROW_THREADS
  return MOE_AR_FIXED_ROW_THREADS;
#else
  return (int)blockDim.x;
#endif
}
__device__ __forceinline__ RowPlace block_row_place() {
#ifdef MOE_AR_FIXED_ROW_THREADS
  __builtin_assume(threadIdx.x < MOE_AR_FIXED_ROW_THREADS);
#endif
  return RowPlace{(int)threadIdx.x, row_threads()};
}

template <typename T> struct Vec;
template <> struct Vec<__half> {
  static __device__ __forceinline__ void to_float(uint4 v, float (&f)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 x = __half22float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
  static __device__ __forceinline__ void to_float_paired(uint4 v, float (&f)[8]) { to_float(v, f); }
  static __device__ __forceinline__ uint4 from_float(const float (&f)[8]) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
  static __device__ __forceinline__ float scalar(const void* p, long long i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
};
template <> struct Vec<__nv_bfloat16> {
  // A bf16 is the top half of its float: a shift and a mask, two instructions a pair where
  // __bfloat1622float2 takes three (it moves the high half down, then back up).
  static __device__ __forceinline__ void to_float(uint4 v, float (&f)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { f[2 * i] = __uint_as_float(w[i] << 16); f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
  }
  // The same values by the intrinsic, kept where ptxas places its spills better with it: the pipelined
  // two-shot's NVFP4 rounds at its register cap (bench_results/nvfp4_epilogue/).
  static __device__ __forceinline__ void to_float_paired(uint4 v, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 x = __bfloat1622float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
  static __device__ __forceinline__ uint4 from_float(const float (&f)[8]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
  static __device__ __forceinline__ float scalar(const void* p, long long i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
};

// Read-only for the whole call (ld.global.nc).
__device__ __forceinline__ uint4 load_readonly(const void* p) {
  return __ldg(static_cast<const uint4*>(p));
}
// Read once, never again in this call (ld.global.cs: evict first from L1 and L2).
__device__ __forceinline__ uint4 load_streaming(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// max |x_i| of one vector, in float (exact: the dtype converts to float exactly); NaNs are skipped
// (fmaxf returns the other operand) and all-NaN gives 0. As a tree: four dependent steps, not eight.
// kPairedConvert: see Vec::to_float_paired.
template <typename D, bool kPairedConvert = false>
__device__ __forceinline__ float amax_of(uint4 v) {
  float x[8];
  if constexpr (kPairedConvert) Vec<D>::to_float_paired(v, x);
  else Vec<D>::to_float(v, x);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = fmaxf(fabsf(x[i]), fabsf(x[i + 4]));
  return fmaxf(fmaxf(fmaxf(x[0], x[2]), fmaxf(x[1], x[3])), 0.f);
}

// A division x / s as multiply-adds, given y = RN(1/s) and q = RN(x * y): q corrected by its exact
// remainder (taken as q * s - x, not x - q * s, so that -0 stays -0). Where no step underflows or
// overflows this is the correctly rounded x / s; the callers say where they use it and how that was
// checked. Three instructions; __fdiv_rn takes about seven and a branch to its slow path.
__device__ __forceinline__ float corrected_quotient(float x, float s, float y, float q) {
  return __fmaf_rn(-__fmaf_rn(q, s, -x), y, q);
}

}  // namespace moe_ar
