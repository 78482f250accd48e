// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/moe_finalize_allreduce.cuh.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// MoE finalize + all-reduce over NVLink + residual add + RMSNorm (+ NVFP4 or FP8), one kernel per rank.
//
// Every program is this body instantiated for one (dtype, world size, output profile, regime,
// shared-expert prefetch); the thin files in programs/ only name the instantiation. The loader
// compiles the program file with the line that includes this file replaced by this file's text.
//
// Exchange: Lamport. Every rank owns three rotating buffers in its own memory, pre-filled with the
// -0.0 bit pattern (the sentinel). Peers store 16-byte vectors of payload straight into them over
// NVLink (a payload -0.0 travels as +0.0); the owner polls its own buffer with volatile 16-byte
// loads until no sentinel is left. Call n writes and reads buffer n % 3 and clears the buffer of
// call n - 1, which no peer writes again before call n + 2 (a peer cannot finish call n + 1
// before this rank has sent its call n + 1 data, so the clear is always done first).
//
//   one-shot:   partial -> every peer's slot[rank][t]      | poll W slots, sum in rank order,
//                                                          | + residual, norm, quant (all tokens)
//   two-shot:   partial -> owner(t)'s slot[rank][t]        | owner: poll W slots, sum, + residual,
//               (owner(t) = t / ceil(T / W))               |   residual_out -> every rank's row t
//                                                          | all: poll row t, norm, quant
//
// All state (call counter, extent written into each buffer) lives in this rank's device memory,
// so a captured CUDA graph replays correctly, and both regimes share it, so T may cross regime
// boundaries between calls. Every wait on a peer has a deadline (Params.timeout_ns): on expiry
// the thread records rank and phase in the host-mapped error words, stops waiting, writes NaN
// where the missing data would have gone and sends nothing further, so its peers time out too
// rather than reduce what never arrived.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>


namespace moe_ar {

enum class Profile { kPlain, kNvfp4, kFp8Group128, kFp8Tensor };
enum class Regime { kOneShot, kTwoShot, kTwoShotEarly, kTwoShotPipelined };

constexpr int kMaxWorldSize = 16;
constexpr int kMaxVecPerThread = 4;
constexpr int kMaxThreads = 512;
constexpr int kElemsPerVec = 8;             // a 16-byte vector holds 8 elements of a 2-byte dtype
constexpr unsigned kSentinelWord = 0x80008000u;  // two -0.0 halves
constexpr unsigned kNanWord = 0x7fff7fffu;       // two NaN halves (fp16 and bf16 alike)
constexpr float kE4m3Max = 448.f;                // largest finite FP8 E4M3 value
constexpr int kFp8Group = 128;                   // elements per FP8 scale group: 16 vectors
constexpr float kFp8GroupEps = 1e-10f;           // floor of a group's amax
// Params.quant_flags (profile fp8_group128)
enum QuantFlag { kScalesColumnMajor = 1, kScalesPow2 = 2 };

// Device state words of one rank (Params.state).
// kBadRows counts routes skipped because their row was >= R (read by dispatch.check()).
enum StateWord { kCallCounter = 0, kExtent0 = 1, kDoneBlocks = 4, kBadRows = 5, kStateWords = 8 };
// Host-mapped error words (Params.error), read by the host without a synchronization.
enum ErrorWord { kErrCode = 0, kErrPhase = 1, kErrRank = 2 };
enum ErrorCode { kErrNone = 0, kErrTimeout = 1 };
enum Phase { kPhaseNone = 0, kPhaseReduceScatter = 1, kPhaseAllGather = 2, kPhaseOneShot = 3 };

// The kernel's only argument, passed by value. Field order and types come from generator/abi.py;
// the manifest carries the same plan so the runtime fills a matching ctypes structure.
struct Params {
  const void* allreduce_in;  // [R, H] dtype, permuted expert rows (this rank's partials)
  const int* expanded_idx;  // [T, K] int32 row of allreduce_in per (token, route); < 0 = dropped
  const void* expert_scale;  // [T, K] dtype or fp32 router weights, or null (= 1)
  const void* shared_in;  // [T, H] dtype shared-expert partial, or null
  const void* residual_in;  // [T, H] dtype
  const void* norm_weight;  // [H] dtype RMSNorm gamma
  const float* quant_scale;  // [1] fp32: NVFP4 global scale (nvfp4), FP8 per-tensor scale (fp8_tensor), else null
  void* norm_out;  // [T, H] dtype
  void* residual_out;  // [T, H] dtype
  void* quant_out;  // [T, H/2] uint8 packed E2M1 (nvfp4); [T, H] FP8 E4M3 (fp8_*); else null
  void* scale_out;  // swizzled 128x4 E4M3 scales (nvfp4); fp32 group scales (fp8_group128); else null
  void* peer_buffers[16];  // Lamport buffer base of every rank (3 rotating buffers each), by rank
  unsigned* state;  // this rank's device state words (call counter, extents, done counter)
  unsigned* error;  // host-mapped error words: code, phase, rank, bad-index count
  long long buffer_elems;  // elements of dtype in one rotating buffer
  unsigned long long timeout_ns;  // deadline for any wait on a peer, in ns (0 = none)
  int tokens;  // T
  int hidden;  // H
  int top_k;  // K
  int rows;  // R, rows of allreduce_in (indices >= R are skipped and counted)
  int rank;  // this rank
  int scale_kind;  // 0: no expert_scale, 1: fp32, 2: dtype
  int vec_per_thread;  // 16-byte vectors of a row held by one thread
  int quant_flags;  // fp8_group128: 1 = column-major scales [H/128, roundup(T, 4)], 2 = power-of-two scales
  int fault_stop_after;  // fault injection for tests: > 0 sends only that many phase-1 units, then stops; 0 normally
  float routed_scaling_factor;  // multiplies the routed sum
  float eps;  // RMSNorm epsilon
  float weight_bias;  // 0, or 1 for (1 + gamma)
};

// ---------------------------------------------------------------------------------------------
// dtype helpers: 8 elements <-> 8 floats
// ---------------------------------------------------------------------------------------------
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
  // two-shot's NVFP4 rounds at its register cap (at c15d933 on sm_90a, 60 / 80 bytes of spills
  // stored / loaded with it, 152 / 232 with to_float).
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

// ---------------------------------------------------------------------------------------------
// Lamport vectors, memory access, PDL, timer
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ bool has_sentinel(uint4 v) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) any |= ((w[i] & 0xffffu) == 0x8000u) | ((w[i] >> 16) == 0x8000u);
  return any;
}
// A payload -0.0 would read as "not arrived yet": send it as +0.0.
__device__ __forceinline__ uint4 without_sentinel(uint4 v) {
  unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if ((w[i] & 0xffffu) == 0x8000u) w[i] &= 0xffff0000u;
    if ((w[i] >> 16) == 0x8000u) w[i] &= 0x0000ffffu;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 { %0, %1, %2, %3 }, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 load_readonly(const void* p) {
  return __ldg(static_cast<const uint4*>(p));
}
// Read once, never again in this call (ld.global.cs: evict first from L1 and L2).
__device__ __forceinline__ uint4 load_streaming(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The state words are written by the previous call's last block, on some other SM, and with PDL this
// kernel starts while that call still runs: read them from L2, never from a possibly stale L1 line.
// (Tried against the PDL-burst timeouts of bench_results/gpu_tests/README.md: it did not change them;
// kept as the safe read.)
__device__ __forceinline__ unsigned load_state(const unsigned* p) { return __ldcg(p); }
// Programmatic dependent launch: both are no-ops when the launch did not ask for it.
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_next_kernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

struct Deadline {
  unsigned long long at;  // 0: no deadline
  bool expired;           // this thread gave up waiting (stays set: no further waits)
};

// Out of line: it runs at most once per thread. It takes scalars, not Params, so that the kernel
// argument is never copied to local memory.
__device__ __noinline__ void record_timeout(unsigned* error, int rank, int phase) {
  volatile unsigned* e = error;
  e[kErrPhase] = phase;
  e[kErrRank] = rank;
  __threadfence_system();
  e[kErrCode] = kErrTimeout;
}

// s += residual_in[t], vector v (fp32; the caller rounds once).
template <typename D>
__device__ __forceinline__ void add_residual(const Params& p, int t, int v, float (&s)[8]) {
  float x[8];
  const uint4* in = reinterpret_cast<const uint4*>(static_cast<const D*>(p.residual_in) + (long long)t * p.hidden +
                                                   v * kElemsPerVec);
  Vec<D>::to_float(*in, x);
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] += x[i];
}

// Wait for kSources Lamport slots of this thread's vectors in rounds [r_begin, r_end) and reduce them:
// vector v = r * blockDim.x + threadIdx.x of slot q is at base + q * slot_stride + v * 8.
// out[r] = D(sum over q in rank order (+ residual_in[t] if kAddResidual)), rounded once, so every
// rank computes the same bits. A pass issues every slot's load of a round before using any (one
// memory latency per round, not one per vector); passes repeat until no vector holds the sentinel,
// or the deadline passes.
template <typename D, int kSources, bool kAddResidual, bool kOneRoundAtATime = false>
__device__ __forceinline__ void wait_and_reduce(const D* base, long long slot_stride, int r_begin, int r_end, int t,
                                                uint4 (&out)[kMaxVecPerThread], Deadline& d, const Params& p,
                                                int phase) {
  const int nvec = p.hidden / kElemsPerVec;
  // kOneRoundAtATime: the rounds run one after the other (not unrolled), so no two rounds' loads are
  // in flight together (the two-shot's reduce of 16 ranks spilled 200-570 bytes unrolled); out[r] is
  // then written by compile-time index (a run-time index would put out in local memory).
  constexpr int kRoundsUnrolled = kOneRoundAtATime ? 1 : kMaxVecPerThread;
  while (true) {
    bool arrived = true;
#pragma unroll (kRoundsUnrolled)
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (r < r_begin || r >= r_end || v >= nvec) continue;
      uint4 in[kSources];
#pragma unroll
      for (int q = 0; q < kSources; ++q)
        in[q] = load_volatile(reinterpret_cast<const uint4*>(base + q * slot_stride + (long long)v * kElemsPerVec));
      float s[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = 0.f;
#pragma unroll
      for (int q = 0; q < kSources; ++q) {  // rank order
        arrived &= !has_sentinel(in[q]);
        float x[8];
        Vec<D>::to_float(in[q], x);
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] += x[i];
      }
      if (kAddResidual) add_residual<D>(p, t, v, s);
      const uint4 result = kSources == 1 && !kAddResidual ? in[0] : Vec<D>::from_float(s);
      if (kRoundsUnrolled == kMaxVecPerThread) {
        out[r] = result;
      } else {
#pragma unroll
        for (int k = 0; k < kMaxVecPerThread; ++k)
          if (k == r) out[k] = result;
      }
    }
    if (arrived) return;
    if (d.expired) break;
    if (d.at != 0 && global_timer_ns() > d.at) {
      record_timeout(p.error, p.rank, phase);
      d.expired = true;
    }
  }
  // Gave up: what this thread holds is not the sum; make that visible instead of plausible.
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) out[r] = make_uint4(kNanWord, kNanWord, kNanWord, kNanWord);
}

// Wait for one Lamport vector: what wait_and_reduce does for one source and one vector, for loops
// that cannot keep a whole row in registers. NaN once the deadline has passed.
__device__ __forceinline__ uint4 wait_vector(const uint4* addr, Deadline& d, const Params& p, int phase) {
  while (!d.expired) {
    const uint4 v = load_volatile(addr);
    if (!has_sentinel(v)) return v;
    if (d.at != 0 && global_timer_ns() > d.at) {
      record_timeout(p.error, p.rank, phase);
      d.expired = true;
    }
  }
  return make_uint4(kNanWord, kNanWord, kNanWord, kNanWord);
}

// Rank q's buffer base. Selected with compile-time indices: a run-time index into the kernel
// argument would copy the whole argument to local memory.
template <int W>
__device__ __forceinline__ void* buffer_of(const Params& p, int q) {
  void* b = p.peer_buffers[0];
#pragma unroll
  for (int i = 1; i < W; ++i)
    if (q == i) b = p.peer_buffers[i];
  return b;
}

// ---------------------------------------------------------------------------------------------
// The layout of one call in a rotating buffer (elements of dtype)
// ---------------------------------------------------------------------------------------------
struct Layout {
  int tokens_per_owner;  // two-shot: C = ceil(T / W); one-shot: T
  long long gather_base; // two-shot: start of the all-gather rows; one-shot: unused
  long long extent;      // elements written into each rank's buffer by this call
};

template <Regime R, int W>
__device__ __forceinline__ Layout layout_of(int T, int H) {
  Layout l;
  if (R == Regime::kOneShot) {
    l.tokens_per_owner = T;
    l.gather_base = 0;
    l.extent = (long long)W * T * H;
  } else {
    l.tokens_per_owner = (T + W - 1) / W;
    l.gather_base = (long long)W * l.tokens_per_owner * H;
    l.extent = l.gather_base + (long long)T * H;
  }
  return l;
}

// ---------------------------------------------------------------------------------------------
// Phase 1: this rank's partial of one 16-byte vector of token t, rounded once to the dtype.
// kRoutes routes at a time: that many independent 16-byte loads in flight. kSharedFirst issues the
// shared expert's load before the routes' (in flight with them, one register vector held longer).
// Neither changes the order of the additions, so not the result's bits. kStreaming: the routes' and
// the shared row's loads evict first (see pipelined_two_shot).
// ---------------------------------------------------------------------------------------------
template <typename D, bool kSharedPrefetch, int kRoutes = 4, bool kSharedFirst = false, bool kStreaming = false>
__device__ __forceinline__ uint4 partial_vector(const Params& p, int t, int v, unsigned& bad_rows) {
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
  return without_sentinel(Vec<D>::from_float(out));
}

// ---------------------------------------------------------------------------------------------
// Block-wide sum (deterministic for a given block size)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float y = lane < (int)(blockDim.x / 32) ? warp_sums[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
    if (lane == 0) total = y;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();  // total and warp_sums are reused by the next row
  return r;
}

// ---------------------------------------------------------------------------------------------
// NVFP4: software E2M1 rounding (sm_90 has no cvt to e2m1), exact to the rule in the spec
// ---------------------------------------------------------------------------------------------
// Two codings of the rule (tests/reference.py: count the midpoints |q| lies above, ties to the even
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
// column's. The quantization takes the row's part once a row (computed in every round, it took
// uniform-datapath instructions in each: bench_results/oneshot/, Nsight Compute of c15d933).
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
// Filled before the first row's epilogue; the block_sum barriers of that row publish it before any lookup.
// A byte with the sign bit (b + 128) holds the negated entry of b: both divisions are exact to the sign,
// 1 / (-v / gs) = -(1 / (v / gs)), -0 (b = 128) included; so a thread computes a pair, in one round
// (with 256 entries a block of 224 threads took two, on the one-shot's critical path at 1 row a block).
// A NaN entry (0x7F, 0xFF) may differ in sign only, which no product shows (x * NaN is the one NaN).
__device__ __forceinline__ void fill_nvfp4_reciprocals(const Params& p) {
  float* table = nvfp4_reciprocals();
  const float gs = *p.quant_scale;
  for (int b = threadIdx.x; b < kE4m3Codes / 2; b += blockDim.x) {
    const float v = __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
    const float reciprocal = __fdiv_rn(1.0f, __fdiv_rn(v, gs));
    table[b] = b != 0 ? reciprocal : 0.0f;  // byte compare, as the kernel always did
    table[b + kE4m3Codes / 2] = -reciprocal;
  }
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
// by e2m1x8 (every program but one: NVFP4 epilogues are issue-bound; bench_results/nvfp4_epilogue/
// and oneshot/); otherwise the division, e2m1_code per element and the dtype's paired conversion,
// kept for the pipelined two-shot with register loads, which with the others spilled more at its
// register cap of 72 and ran slower (2x H200, bench_results/nvfp4_epilogue/: 1-6% from 128 tokens
// with the first multiply-add coding of the scale byte and signs; 15-28% with the shift-and-mask bf16
// conversion in its rounds, 2-5% with a compare-free E2M1 coding alone). The one with the row ring
// has the registers (121 of 128, no spills) and takes the fewest instructions.
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
//     (amax, shuffle, a division, a table lookup) overlap; the pipelined two-shots, which run at a
//     register cap anyway, are 18-29% faster with it than with the other (kFewestInstructions: see
//     quantize_vector_nvfp4; the other schedule always takes the fewest);
//   otherwise one round after another: the uncapped one-shot takes 64 registers instead of 105, twice
//     the blocks a multiprocessor holds, and is 12-17% faster from 512 tokens (both on 2x H200).
// Each form is kept as it was measured: at a register cap ptxas places its spills differently after
// small changes of the source (the one-round form in the pipelined two-shot was slower though it
// spilled no more; bench_results/quant_rounds/).
template <typename D, bool kOverlapRounds, bool kFewestInstructions, bool kStreamingStores>
__device__ __forceinline__ void quantize_row_nvfp4(const Params& p, int t, const uint4 (&normed)[kMaxVecPerThread],
                                                   float gs) {
  const int H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread, num_k_tiles = (H + 63) / 64;
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
      const int v = r * blockDim.x + threadIdx.x;
      if (r >= vpt || v >= nvec) continue;
      quantize_vector_nvfp4<D, kFewestInstructions, kStreamingStores>(quant_row, scale_row, v, normed[r], amax[r], gs);
    }
  } else {
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      if (r >= vpt) break;  // the same for the whole block: every lane below shuffles
      const float own_amax = amax_of<D>(normed[r]);  // 0 for vectors past the row
      const float amax = fmaxf(own_amax, __shfl_xor_sync(0xffffffffu, own_amax, 1));
      const int v = r * blockDim.x + threadIdx.x;
      if (v >= nvec) continue;
      quantize_vector_nvfp4<D, /*kFewestInstructions=*/true, kStreamingStores>(quant_row, scale_row, v, normed[r], amax,
                                                                               gs);
    }
  }
}

// The padding rows T..roundup(T, 128)-1 all lie in the last 128-row tile, which is one 512-byte
// block per group of 4 scale columns: 16-byte chunk j of a block holds rows j, 32 + j, 64 + j and
// 96 + j of the tile, a 4-byte word each. The whole grid zeroes the padding rows' words, a chunk a
// thread, consecutive threads on consecutive chunks (at small T the grid is a few blocks: a row per
// block was the critical path, and a word per thread was 15% of the one-shot's instructions at T = 1).
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
// epilogue, it took registers the epilogue needs (one-shot at world size 4: 98 against 64).
__device__ __forceinline__ void zero_scale_padding(const Params& p) {
  zero_scale_padding_rows(p);
  const int cols = p.hidden / 16, padding_cols = (cols + 3) / 4 * 4 - cols, num_k_tiles = (p.hidden + 63) / 64;
  const int n = p.tokens * padding_cols;  // 0 when H % 64 == 0
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    static_cast<unsigned char*>(p.scale_out)[swizzled_scale_offset(i / padding_cols, cols + i % padding_cols,
                                                                   num_k_tiles)] = 0;
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3 (hardware convert: round to nearest even, saturating), exact to the rule in the spec
// ---------------------------------------------------------------------------------------------
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
__device__ __forceinline__ void quantize_row_fp8_group(const Params& p, int t, const uint4 (&normed)[kMaxVecPerThread]) {
  const int H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread, groups = H / kFp8Group;
  const bool column_major = p.quant_flags & kScalesColumnMajor, pow2 = p.quant_flags & kScalesPow2;
  uint2* quant = reinterpret_cast<uint2*>(static_cast<unsigned char*>(p.quant_out) + (long long)t * H);
  // scale of group g: scale_row[g * group_stride]. An int: the offset stays below (H / 128) * (T + 3), and an
  // int here keeps the function at 64 registers (a 64-bit stride took 74, one block less a multiprocessor).
  const int group_stride = column_major ? (p.tokens + 3) / 4 * 4 : 1;
  float* scale_row = static_cast<float*>(p.scale_out) + (column_major ? (long long)t : (long long)t * groups);
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    if (r >= vpt) break;  // the same for the whole block: every lane below shuffles
    float amax = amax_of<D>(normed[r]);  // 0 for vectors past the row
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int v = r * blockDim.x + threadIdx.x;
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
                                                        float s) {
  const int H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  uint2* quant = reinterpret_cast<uint2*>(static_cast<unsigned char*>(p.quant_out) + (long long)t * H);
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * blockDim.x + threadIdx.x;
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

// ---------------------------------------------------------------------------------------------
// Epilogue of one token row: residual_out values (in the dtype, held in registers)
// -> RMSNorm -> norm_out (+ NVFP4 or FP8). The whole block calls it for the same row.
// ---------------------------------------------------------------------------------------------
// kOverlapQuantRounds, kFewestQuantInstructions: see quantize_row_nvfp4. kStreamingStores: the
// stores of norm_out and of the quantized row evict first (see pipelined_two_shot).
template <typename D, Profile P, bool kOverlapQuantRounds = false, bool kFewestQuantInstructions = true,
          bool kStreamingStores = false>
__device__ __forceinline__ void norm_row(const Params& p, int t, const uint4 (&res)[kMaxVecPerThread]) {
  const int H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  // The global scale of the quantized output, like gamma read before the block reduction, which hides
  // its latency (read per NVFP4 vector, it was on each vector's dependent chain).
  const float quant_scale = P == Profile::kFp8Tensor || P == Profile::kNvfp4 ? __ldg(p.quant_scale) : 0.f;
  uint4 gamma[kMaxVecPerThread];  // loaded before the block reduction, which hides their latency
  float sumsq = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * blockDim.x + threadIdx.x;
    gamma[r] = make_uint4(0, 0, 0, 0);
    if (r < vpt && v < nvec) {
      gamma[r] = load_readonly(static_cast<const D*>(p.norm_weight) + v * kElemsPerVec);
      float x[8];
      Vec<D>::to_float(res[r], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) sumsq = fmaf(x[i], x[i], sumsq);
    }
  }
  const float rms = rsqrtf(__fdiv_rn(block_sum(sumsq), (float)H) + p.eps);
  D* norm_out = static_cast<D*>(p.norm_out) + (long long)t * H;
  uint4 normed[kMaxVecPerThread];  // norm_out in the dtype: what the quantized outputs encode
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * blockDim.x + threadIdx.x;
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
    quantize_row_nvfp4<D, kOverlapQuantRounds, kFewestQuantInstructions, kStreamingStores>(p, t, normed, quant_scale);
  if (P == Profile::kFp8Group128) quantize_row_fp8_group<D, kStreamingStores>(p, t, normed);
  if (P == Profile::kFp8Tensor) quantize_row_fp8_tensor<D, kStreamingStores>(p, t, normed, quant_scale);
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping: every block counts itself in (kDoneBlocks) once all of its threads have used the
// state words they read at its start; the block that counts in last advances the state at its end.
// ---------------------------------------------------------------------------------------------
// The one-shot counts in right after the clear (its extent is the last state word it uses), so the
// count's round trip overlaps the wait for the peers instead of ending the call (1-4 tokens 4-6%
// faster, FP8 and NVFP4 at 1,024 1% slower: the barrier). The two-shots count in at their end: the
// pipelined one uses the extent until its last column, and the others, holding the count through
// their phases, spilled past the compile budget at world size 8 (NVFP4). No fence anywhere (two
// cost 0.5-0.8 us a call): the last block reads nothing the other blocks wrote, and the next call
// reads the state only after this grid has completed (stream order, or griddepcontrol.wait under
// PDL), which makes all of its writes visible.
// bench_results/oneshot/ (fences/, count_in/).
__device__ __forceinline__ unsigned count_in(const Params& p) {
  __syncthreads();  // every thread of the block is past its use of the state words
  return threadIdx.x == 0 ? atomicAdd(p.state + kDoneBlocks, 1u) : 0u;
}

__device__ __forceinline__ void finish_call(const Params& p, unsigned counted_before, unsigned call, int cur, int prev,
                                            long long extent, unsigned bad_rows) {
  if (bad_rows) atomicAdd(p.state + kBadRows, bad_rows);
  if (threadIdx.x == 0 && counted_before == gridDim.x - 1) {  // this block counted in last
    p.state[kExtent0 + cur] = (unsigned)extent;
    p.state[kExtent0 + prev] = 0;
    p.state[kCallCounter] = call + 1;
    p.state[kDoneBlocks] = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// Row ring (the pipelined two-shot): the rows of a block's partials come into shared memory by bulk
// copy (cp.async.bulk, sm_90 and sm_100), kStages rows ahead of their use.
// ---------------------------------------------------------------------------------------------
// Thread 0 issues the copies. Each stage has an mbarrier that completes when its row has landed;
// every thread adds its vectors of the row from shared memory, the block meets at a barrier, and
// thread 0 refills the stage with the row kStages further on. So the rows in flight hold no
// registers, and stay in flight while the block waits for its peer or normalizes a row. A probe of
// the partials alone on one H200 (H 7168, top_k 8 + shared, 8,192 tokens) read 3.98 TB/s this way
// (copy: 4.06) against 2.65 with 16-byte register loads, four routes at a time, at the same
// occupancy (bench_results/pipelined/row_ring/).
//
// The rows come in the order the block uses them: its partial units (partial_unit_token), in each
// routes 0..K-1, then the shared row, and in a unit of this rank's own token (phase 2) last its
// residual_in row, which the reduction adds after the peer's partial has arrived. A route whose row
// is out of range gets no copy: its stage's barrier is arrived on without bytes, and the reader
// adds zero, as partial_vector does.
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ bool mbarrier_done(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done;
}

// The token of a block's partial unit u (0 .. 2 * columns - 1) of the pipelined two-shot, in the
// order its steps use them: phase 1 of column 0; at each step k >= 1 phase 1 of column k, then
// phase 2 of column k - 1; last, phase 2 of the last column. A token >= T has no partial.
__device__ __forceinline__ int partial_unit_token(int u, int columns, int rank, int C) {
  int column = u / 2 - 1, owner = rank;  // u even: phase 2 of column u / 2 - 1
  if (u == 2 * columns - 1) column = columns - 1;
  else if (u == 0) column = 0, owner = 1 - rank;
  else if (u & 1) column = (u + 1) / 2, owner = 1 - rank;
  return owner * C + blockIdx.x + column * gridDim.x;
}

template <typename D, int kStages>
struct RowRing {
  static_assert(kStages >= 1 && kStages <= 16, "the barriers take the first 128 bytes");
  unsigned char* rows;  // kStages rows of H elements, in dynamic shared memory
  unsigned bars;        // shared address of kStages mbarriers, 8 bytes each
  unsigned used;        // rows read so far (every thread)
  // The producer's cursor (thread 0 only): the next row to issue is route `route` of unit `unit`.
  int unit, route, units, columns, C;
  unsigned issued;
  unsigned long long policy;  // L2 evict-first: every row is read once

  __device__ __forceinline__ void start(unsigned char* smem, int block_columns, int tokens_per_owner, const Params& p) {
    bars = smem_address(smem);
    rows = smem + 128;  // 16 barriers at most
    used = issued = 0;
    unit = route = 0;
    columns = block_columns;
    units = 2 * block_columns;
    C = tokens_per_owner;
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int s = 0; s < kStages; ++s) issue_next(p);
  }

  // Thread 0: copy the next row of the block's sequence into its stage (nothing once all are issued).
  __device__ __forceinline__ void issue_next(const Params& p) {
    const int K = p.top_k, partials = K + (p.shared_in != nullptr ? 1 : 0);
    for (; unit < units; ++unit, route = 0) {
      const int t = partial_unit_token(unit, columns, p.rank, C);
      const bool own_token = t / C == p.rank;  // phase 2: its residual_in row comes last
      if (t >= p.tokens || route >= partials + (own_token ? 1 : 0)) continue;
      const D* src = static_cast<const D*>(route == partials ? p.residual_in : p.shared_in) + (long long)t * p.hidden;
      if (route < K) {
        const int row = p.expanded_idx[(long long)t * K + route];
        src = row >= 0 && row < p.rows ? static_cast<const D*>(p.allreduce_in) + (long long)row * p.hidden : nullptr;
      }
      const int s = issued % kStages;
      const unsigned bar = bars + 8 * s, bytes = p.hidden * sizeof(D);
      if (src != nullptr) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
            ::"r"(smem_address(rows + (size_t)s * bytes)), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
      } else {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
      }
      ++issued;
      ++route;
      return;
    }
  }

  // The next row, once it has landed.
  __device__ __forceinline__ const uint4* wait_row(const Params& p) {
    const int s = used % kStages;
    while (!mbarrier_done(bars + 8 * s, (used / kStages) & 1)) {
    }
    return reinterpret_cast<const uint4*>(rows + (size_t)s * p.hidden * sizeof(D));
  }
  // Every thread is done with the row: its stage takes the row kStages further on.
  __device__ __forceinline__ void release_row(const Params& p) {
    __syncthreads();
    ++used;
    if (threadIdx.x == 0) issue_next(p);
  }
};

// This rank's partial of token t from the ring, each thread's vectors rounded once to the dtype:
// partial_vector's additions in its order (so the same bits), one row at a time.
template <typename D, int kStages>
__device__ __forceinline__ void partial_row(const Params& p, RowRing<D, kStages>& ring, int t,
                                            uint4 (&out)[kMaxVecPerThread], unsigned& bad_rows) {
  const int K = p.top_k, nvec = p.hidden / kElemsPerVec, vpt = p.vec_per_thread;
  float acc[kMaxVecPerThread][8];
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  for (int k = 0; k < K; ++k) {
    const int row = p.expanded_idx[(long long)t * K + k];
    const bool in_range = row >= 0 && row < p.rows;
    if (row >= p.rows && threadIdx.x == 0) bad_rows += nvec;  // one a 16-byte vector, as partial_vector counts
    float s = 0.f;
    if (in_range) {
      if (p.scale_kind == 0) s = 1.f;
      else if (p.scale_kind == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
      else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
    }
    const uint4* stage = ring.wait_row(p);
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (r >= vpt || v >= nvec) continue;
      float x[8];
      Vec<D>::to_float(in_range ? stage[v] : make_uint4(0, 0, 0, 0), x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(s, x[i], acc[r][i]);
    }
    ring.release_row(p);
  }
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] *= p.routed_scaling_factor;
  if (p.shared_in != nullptr) {
    const uint4* stage = ring.wait_row(p);
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (r >= vpt || v >= nvec) continue;
      float x[8];
      Vec<D>::to_float(stage[v], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r][i] += x[i];
    }
    ring.release_row(p);
  }
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) out[r] = without_sentinel(Vec<D>::from_float(acc[r]));
}

// ---------------------------------------------------------------------------------------------
// Two-shot, pipelined (world size 2): the two-shot's three phases side by side, not one after another.
// ---------------------------------------------------------------------------------------------
// Same buffers, layout and Lamport sequence as the two-shot (one protocol class). Column j is token j
// of each owner (t = o * C + j). Block b takes columns b, b + G, b + 2G, ... (G = gridDim.x, which the
// launcher sizes so that every block takes the same number of columns, give or take one: a last
// round that only some blocks run leaves HBM idle; dispatch/op.py, balanced_grid); at its step k it
//   sends this rank's partial of the peer's token of column j_k     (HBM reads, NVLink writes)
//   clears column j_k's share of the previous call's buffer          (HBM writes)
//   reduces its own token of column j_k-1: its own partial computed  (HBM reads, a wait)
//     here, the peer's from the buffer; writes residual_out and
//     norm_out, sends residual_out to the peer                       (HBM and NVLink writes)
//   normalizes the peer's token of column j_k-2 as the peer sent it  (a wait, HBM writes)
// so one column's reads overlap the exchange of the columns before. Two savings in HBM traffic over
// the two-shot: nothing this rank computes goes through its own buffer (the two-shot sends half of
// its partials and residual rows to itself, to HBM and back), and every received vector is cleared
// as soon as it is read, while its line is still in L2, so the call leaves its buffer clean (extent
// 0: the next call clears nothing) and a received line is written back to HBM once, not twice.
// After a timeout the buffer may hold late arrivals; the required reset() refills it.
// Every wait concerns a column whose sends come earlier in both ranks' order than any send still
// waiting behind it, so the exchange always progresses (also when the ranks run different grid
// sizes or mix programs).
// The rows of the partials (phases 1 and 2) and residual_in come through the row ring when
// kRowStages > 0 (RowRing; the family twoshot_pipelined), else as 16-byte register loads, kRoutes
// at a time per vector (partial_vector; twoshot_pipelined_loads, more blocks a multiprocessor).
// Against the register loads, in same-run A/Bs on 2x H200, H 7168 top_k 8 + shared, the ring is faster from 1,024 to
// 16,384 tokens for plain (2-9%) and FP8-tensor (3-8%); FP8-group 4.5% slower at 1,024 and 1.5-7%
// faster from 4,096; NVFP4 3-5.5% slower at 512-1,024, 0.7% faster at 8,192 and 3.5% at 16,384.
// The selection table says which serves which T (spec.py: PIPELINED_ROW_STAGES, PIPELINED_LOADS,
// the caps). residual_in through the ring, and phase 2 waiting for the peer's whole row at once
// rather than vector by vector (each vector's wait then its residual_in load, in turn): from 1,024
// to 16,384 tokens 0.3-4.7% faster, every profile (2.4-3.5% at 2,048); at 512 1.0-1.7% slower (the
// tables fitted to 529cb84's bench select another family there; bench_results/pipelined/row_ring/).
// Cache policy: what the call touches once goes through L2 evict-first (ld/st .cs, and the ring's
// copies): the routed and shared rows, residual_in, the outputs (norm_out, the quantized row, the
// peer's residual_out rows) and the sentinels that clear received vectors. L2 then keeps what is
// used again within a step: vectors the peer sent, until they are read, and this rank's
// residual_out rows, normalized in phase 3. 2x H200, H 7168 top_k 8 + shared, 1,024 to 16,384
// tokens, against the default policy (register loads): plain 5-9% faster, FP8 6-14%, NVFP4 2-6%
// faster up to 8,192 tokens and 0.5% slower at 16,384 (bench_results/pipelined/cache_policy/).
// Pulling the next rows toward L2 ahead of use was slower.
template <typename D, int W, Profile P, int kRoutes, bool kSharedFirst, int kRowStages>
__device__ __forceinline__ void pipelined_two_shot(const Params& p, const Layout& lay, int cur, long long prev_extent,
                                                   Deadline& deadline, unsigned& bad_rows) {
  static_assert(W == 2, "the pipelined two-shot is generated for world size 2 only (generator/policy.py)");
  const int T = p.tokens, H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread, C = lay.tokens_per_owner;
  const int G = gridDim.x, peer = 1 - p.rank;
  D* my_buffer = static_cast<D*>(buffer_of<W>(p, p.rank)) + cur * p.buffer_elems;
  D* peer_buffer = static_cast<D*>(buffer_of<W>(p, peer)) + cur * p.buffer_elems;
  uint4* prev_buffer = reinterpret_cast<uint4*>(static_cast<D*>(buffer_of<W>(p, p.rank)) +
                                                ((cur + 2) % 3) * p.buffer_elems);
  const long long clear_n = prev_extent / kElemsPerVec, clear_per_column = (clear_n + C - 1) / C;
  const uint4 sentinel = make_uint4(kSentinelWord, kSentinelWord, kSentinelWord, kSentinelWord);
  if (P == Profile::kNvfp4) zero_scale_padding(p);
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);

  const int columns = blockIdx.x < C ? (C - 1 - blockIdx.x) / G + 1 : 0;  // this block's columns
  extern __shared__ __align__(128) unsigned char dynamic_smem[];
  RowRing<D, (kRowStages > 0 ? kRowStages : 1)> ring;  // unused without the ring
  if constexpr (kRowStages > 0) ring.start(dynamic_smem, columns, C, p);
  for (int k = 0; k < columns + 2; ++k) {
    const int j1 = blockIdx.x + k * G, j2 = j1 - G, j3 = j2 - G;  // the columns of the three phases
    if (k < columns) {
      // phase 1: this rank's partial of the peer's token of column j1 -> the peer's slot [rank][j1]
      const int t = peer * C + j1;
      if (t < T) {
        uint4* slot = reinterpret_cast<uint4*>(peer_buffer + ((long long)p.rank * C + j1) * H);
        if constexpr (kRowStages > 0) {
          uint4 partial[kMaxVecPerThread];
          partial_row(p, ring, t, partial, bad_rows);
#pragma unroll
          for (int r = 0; r < kMaxVecPerThread; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (r < vpt && v < nvec && !deadline.expired) slot[v] = partial[r];
          }
        } else {
          for (int r = 0; r < vpt; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (v >= nvec) continue;
            const uint4 partial = partial_vector<D, false, kRoutes, kSharedFirst, /*kStreaming=*/true>(p, t, v, bad_rows);
            if (!deadline.expired) slot[v] = partial;
          }
        }
      }
      const long long end = min(clear_n, (j1 + 1) * clear_per_column);
      for (long long i = j1 * clear_per_column + threadIdx.x; i < end; i += blockDim.x) prev_buffer[i] = sentinel;
    }
    if (k == columns) allow_next_kernel();  // this block sends no more partials (also a block with none)
    if (k >= 1 && k - 1 < columns) {
      // phase 2: this rank's token of column j2, vector by vector: its own partial (computed here)
      // plus the peer's (polled). a + b == b + a exactly, so the sum has the bits of the two-shot's
      // rank-ordered one. The row goes to residual_out and to the peer; it is normed below.
      const int t = p.rank * C + j2;
      if (t < T) {
        uint4* peer_slot = reinterpret_cast<uint4*>(my_buffer + ((long long)peer * C + j2) * H);
        uint4* residual_out = reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H);
        uint4* peer_row = reinterpret_cast<uint4*>(peer_buffer + lay.gather_base + (long long)t * H);
        const uint4* residual_in =
            reinterpret_cast<const uint4*>(static_cast<const D*>(p.residual_in) + (long long)t * H);
        const auto reduce = [&](int v, uint4 own, uint4 from_peer, uint4 residual) {
          float s[8], x[8];
          Vec<D>::to_float(own, s);
          Vec<D>::to_float(from_peer, x);
          __stcs(peer_slot + v, sentinel);  // read once: clean again for the call that reuses this buffer
#pragma unroll
          for (int i = 0; i < 8; ++i) s[i] += x[i];
          Vec<D>::to_float(residual, x);
#pragma unroll
          for (int i = 0; i < 8; ++i) s[i] += x[i];
          const uint4 res = without_sentinel(Vec<D>::from_float(s));  // as the peer receives it
          residual_out[v] = res;
          // after an expired wait, send nothing: the peer must time out too, not take this as the sum
          if (!deadline.expired) peer_row[v] = res;
        };
        if constexpr (kRowStages > 0) {
          // The whole row at once: every load of the peer's vectors in flight together (one memory
          // latency, not one per vector), and residual_in from the ring (its row comes after the
          // partials: copied while they were added).
          uint4 own[kMaxVecPerThread], from_peer[kMaxVecPerThread];
          partial_row(p, ring, t, own, bad_rows);
          wait_and_reduce<D, 1, false>(reinterpret_cast<const D*>(peer_slot), 0, 0, vpt, t, from_peer, deadline, p,
                                       kPhaseReduceScatter);
          const uint4* residual_row = ring.wait_row(p);
#pragma unroll
          for (int r = 0; r < kMaxVecPerThread; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (r < vpt && v < nvec) reduce(v, own[r], from_peer[r], residual_row[v]);
          }
          ring.release_row(p);
        } else {
#pragma unroll 1
          for (int r = 0; r < vpt; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (v >= nvec) continue;
            const uint4 own = partial_vector<D, false, kRoutes, kSharedFirst, /*kStreaming=*/true>(p, t, v, bad_rows);
            const uint4 from_peer = wait_vector(peer_slot + v, deadline, p, kPhaseReduceScatter);
            reduce(v, own, from_peer, load_streaming(residual_in + v));
          }
        }
      }
    }
    // phase 3: RMSNorm and quantization of two rows: this rank's token of column j2 (from
    // residual_out, just written by these same threads) and the peer's token of column j3 (as the
    // peer sent it; it also goes to residual_out). One loop, so norm_row is inlined once.
#pragma unroll 1
    for (int from_peer = 0; from_peer < 2; ++from_peer) {
      const bool active = from_peer ? k >= 2 : k >= 1 && k - 1 < columns;
      const int t = from_peer ? peer * C + j3 : p.rank * C + j2;
      if (!active || t >= T) continue;  // the same for the whole block: norm_row's barriers stay aligned
      uint4* residual_out = reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H);
      uint4 res[kMaxVecPerThread];
      if (from_peer) {
        uint4* row = reinterpret_cast<uint4*>(my_buffer + lay.gather_base + (long long)t * H);
        wait_and_reduce<D, 1, false>(reinterpret_cast<D*>(row), 0, 0, vpt, t, res, deadline, p, kPhaseAllGather);
#pragma unroll
        for (int r = 0; r < kMaxVecPerThread; ++r) {
          const int v = r * blockDim.x + threadIdx.x;
          if (r >= vpt || v >= nvec) continue;
          __stcs(row + v, sentinel);  // read once: clean again
          __stcs(residual_out + v, res[r]);  // not read again here
        }
      } else {
#pragma unroll
        for (int r = 0; r < kMaxVecPerThread; ++r) {
          const int v = r * blockDim.x + threadIdx.x;
          res[r] = r < vpt && v < nvec ? residual_out[v] : make_uint4(0, 0, 0, 0);
        }
      }
      norm_row<D, P, /*overlap_quant_rounds=*/true, /*fewest_quant_instructions=*/(kRowStages > 0),
               /*streaming_stores=*/true>(p, t, res);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel body
// ---------------------------------------------------------------------------------------------
// kRoutes and kSharedFirst (partial_vector) come from the program (spec.loads_in_flight): the
// one-shot and the pipelined two-shot without the row ring set them; the two-shot programs keep four
// routes at a time, the shared row last. kRowStages: the pipelined two-shot's row ring (0: none).
template <typename D, int W, Profile P, Regime R, bool kSharedPrefetch, int kRoutes = 4, bool kSharedFirst = false,
          int kRowStages = 0>
__device__ __forceinline__ void run(const Params& p) {
  static_assert(W >= 2 && W <= kMaxWorldSize, "world size");
  const int T = p.tokens, H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  // Whole rows per work unit, or one blockDim-wide slice of a row ("round") per unit.
  const bool sliced_send = R == Regime::kOneShot || R == Regime::kTwoShotEarly;
  wait_for_previous_kernel();  // inputs and workspace belong to the previous kernel until here

  Deadline deadline{p.timeout_ns ? global_timer_ns() + p.timeout_ns : 0ull, false};
  unsigned bad_rows = 0;

  // The pipelined two-shot quantizes its first rows while it still sends; the others fill the table
  // after sending their partials (the one-shot 1-4% faster from 128 tokens on 2x H200).
  if (P == Profile::kNvfp4 && R == Regime::kTwoShotPipelined) fill_nvfp4_reciprocals(p);

  const unsigned call = load_state(p.state + kCallCounter);
  const int cur = call % 3, prev = (call + 2) % 3;
  const long long prev_extent = load_state(p.state + kExtent0 + prev);
  const Layout lay = layout_of<R, W>(T, H);
  D* my_buffer = static_cast<D*>(buffer_of<W>(p, p.rank)) + cur * p.buffer_elems;

  // Pull what the waits are followed by toward L2 now, so it is not a DRAM trip after the wait:
  // gamma, and the residual row of this block's first reduced token.
  {
    const int first_reduced = R == Regime::kOneShot ? blockIdx.x : p.rank * lay.tokens_per_owner + blockIdx.x;
    for (int r = 0; r < vpt; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (v >= nvec) break;
      prefetch_l2(static_cast<const D*>(p.norm_weight) + v * kElemsPerVec);
      if (first_reduced < T)
        prefetch_l2(static_cast<const D*>(p.residual_in) + (long long)first_reduced * H + v * kElemsPerVec);
    }
  }

  // Shared-expert variants: pull this block's shared rows toward L2 before anything waits.
  if (kSharedPrefetch && p.shared_in != nullptr) {
    const int units = sliced_send ? T * vpt : T;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int t = sliced_send ? u / vpt : u;
      for (int r = sliced_send ? u % vpt : 0; r < (sliced_send ? u % vpt + 1 : vpt); ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (v < nvec) prefetch_l2(static_cast<const D*>(p.shared_in) + (long long)t * H + v * kElemsPerVec);
      }
    }
  }

  if constexpr (R == Regime::kTwoShotPipelined) {
    if (!p.fault_stop_after) {  // the injected fault takes the two-shot's path below
      pipelined_two_shot<D, W, P, kRoutes, kSharedFirst, kRowStages>(p, lay, cur, prev_extent, deadline, bad_rows);
      finish_call(p, count_in(p), call, cur, prev, 0, bad_rows);  // it leaves its buffer clean: nothing to clear
      return;
    }
  }

  // ---- phase 1: send this rank's partial of every token ------------------------------------
  {
    const int all_units = sliced_send ? T * vpt : T;
    // Fault injection (tests only): a rank with fault_stop_after = n sends its first n units and stops.
    const int units = p.fault_stop_after ? min(p.fault_stop_after, all_units) : all_units;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int t = sliced_send ? u / vpt : u;
      const int r_begin = sliced_send ? u % vpt : 0, r_end = sliced_send ? r_begin + 1 : vpt;
      for (int r = r_begin; r < r_end; ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (v >= nvec) continue;
        const uint4 partial = partial_vector<D, kSharedPrefetch, kRoutes, kSharedFirst>(p, t, v, bad_rows);
        if (R == Regime::kOneShot) {
          const long long offset = cur * p.buffer_elems + ((long long)p.rank * T + t) * H + v * kElemsPerVec;
#pragma unroll
          for (int q = 0; q < W; ++q)
            *reinterpret_cast<uint4*>(static_cast<D*>(p.peer_buffers[q]) + offset) = partial;
        } else {
          const int owner = t / lay.tokens_per_owner, j = t - owner * lay.tokens_per_owner;
          const long long offset =
              cur * p.buffer_elems + ((long long)p.rank * lay.tokens_per_owner + j) * H + v * kElemsPerVec;
          *reinterpret_cast<uint4*>(static_cast<D*>(buffer_of<W>(p, owner)) + offset) = partial;
        }
      }
    }
  }
  allow_next_kernel();
  if (p.fault_stop_after) return;  // the injected fault: this rank never takes part again in this call
  if (R == Regime::kTwoShotPipelined) return;  // not reached (it ran above); keeps what follows out of its code
  if (P == Profile::kNvfp4) fill_nvfp4_reciprocals(p);  // read after the first row's block_sum barriers

  // ---- clear the buffer of the previous call (and the quantized outputs' scale padding) -------
  {
    uint4* prev_buffer = reinterpret_cast<uint4*>(static_cast<D*>(buffer_of<W>(p, p.rank)) + prev * p.buffer_elems);
    const long long n = prev_extent / kElemsPerVec;
    const uint4 sentinel = make_uint4(kSentinelWord, kSentinelWord, kSentinelWord, kSentinelWord);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
      prev_buffer[i] = sentinel;
    if (P == Profile::kNvfp4) zero_scale_padding(p);
    if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  }
  const unsigned counted_before = R == Regime::kOneShot ? count_in(p) : 0u;  // the two-shots: at their end

  // ---- two-shot phase 2: the owner reduces its tokens and sends residual_out to every rank --
  if (R != Regime::kOneShot) {
    const int C = lay.tokens_per_owner;
    const int first = p.rank * C, mine = max(0, min(C, T - first));
    const bool sliced = R == Regime::kTwoShotEarly;
    const int units = sliced ? mine * vpt : mine;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int j = sliced ? u / vpt : u, t = first + j;
      const int r_begin = sliced ? u % vpt : 0, r_end = sliced ? r_begin + 1 : vpt;
      uint4 sum[kMaxVecPerThread];
      wait_and_reduce<D, W, true, (W > 8)>(my_buffer + (long long)j * H, (long long)C * H, r_begin, r_end, t, sum,
                                           deadline, p, kPhaseReduceScatter);
      if (deadline.expired) continue;  // peers must time out too, not take this row as the sum
#pragma unroll
      for (int r = 0; r < kMaxVecPerThread; ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (r < r_begin || r >= r_end || v >= nvec) continue;
        const uint4 res = without_sentinel(sum[r]);
        const long long offset = cur * p.buffer_elems + lay.gather_base + (long long)t * H + v * kElemsPerVec;
#pragma unroll
        for (int q = 0; q < W; ++q) *reinterpret_cast<uint4*>(static_cast<D*>(p.peer_buffers[q]) + offset) = res;
      }
    }
  }

  // ---- last phase, whole rows: residual_out, RMSNorm, quant --------------------------------
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];  // residual_out, already in the dtype
    if (R == Regime::kOneShot)
      wait_and_reduce<D, W, true>(my_buffer + (long long)t * H, (long long)T * H, 0, vpt, t, res, deadline, p,
                                  kPhaseOneShot);
    else
      wait_and_reduce<D, 1, false>(my_buffer + lay.gather_base + (long long)t * H, 0, 0, vpt, t, res, deadline, p,
                                   kPhaseAllGather);
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (r < vpt && v < nvec) reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H)[v] = res[r];
    }
    norm_row<D, P>(p, t, res);
  }

  finish_call(p, R == Regime::kOneShot ? counted_before : count_in(p), call, cur, prev, lay.extent, bad_rows);
}

}  // namespace moe_ar
