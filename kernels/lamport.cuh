// The Lamport exchange and its deadlines. A rotating buffer is pre-filled with the sentinel, the -0.0
// bit pattern; peers store 16-byte vectors of payload straight into the owner's buffer over NVLink (a
// payload -0.0 travels as +0.0), and the owner polls with volatile 16-byte loads until no sentinel is
// left. Every wait has a deadline (Params.timeout_ns); a thread that gives up records the timeout in
// the host-mapped error words and in kPoisoned, and from then on waits for and sends nothing.
#pragma once
#include "call.cuh"
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// maybe_unused: the local programs (world size 1) have no sentinel (unused, it is a compiler warning)
[[maybe_unused]] constexpr unsigned kSentinelWord = 0x80008000u;  // two -0.0 halves
constexpr unsigned kNanWord = 0x7fff7fffu;                        // two NaN halves (fp16 and bf16 alike)

// Whether any of the vector's 8 elements is still the sentinel (not arrived).
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
// A load that always goes to memory: the peers' stores land there while this thread polls.
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 { %0, %1, %2, %3 }, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Deadline {
  unsigned long long at;  // 0: no deadline
  bool expired;           // this thread gave up waiting (stays set: no further waits)
  unsigned call;          // this call's counter (kPoisoned records it)
};

// Out of line: it runs at most once per thread. It takes scalars, not Params, so that the kernel
// argument is never copied to local memory. Also poisons the workspace (kPoisoned) for later kernels.
__device__ __noinline__ void record_timeout(unsigned* error, unsigned* state, unsigned call, int rank, int phase) {
  reinterpret_cast<volatile unsigned*>(state)[kPoisoned] = call + 1;
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
  // in flight together (unrolled, the two-shot's reduce of 16 ranks spilled); out[r] is then written
  // by compile-time index (a run-time index would put out in local memory).
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
      record_timeout(p.error, p.state, d.call, p.rank, phase);
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
      record_timeout(p.error, p.state, d.call, p.rank, phase);
      d.expired = true;
    }
  }
  return make_uint4(kNanWord, kNanWord, kNanWord, kNanWord);
}

}  // namespace moe_ar
