// The row ring of the pipelined two-shot: the rows of a block's partials come into shared memory by
// bulk copy (cp.async.bulk, sm_90 and sm_100), kStages rows ahead of their use.
#pragma once
#include "lamport.cuh"
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// Thread 0 issues the copies. Each stage has an mbarrier that completes when its row has landed;
// every thread adds its vectors of the row from shared memory, the block meets at a barrier, and
// thread 0 refills the stage with the row kStages further on. So the rows in flight hold no
// registers, and stay in flight while the block waits for its peer or normalizes a row: at the same
// occupancy the partials come in much faster than by 16-byte register loads
// (bench_results/pipelined/row_ring/).
//
// The rows come in the order the block uses them: its partial units (partial_unit_token), in each
// routes 0..K-1, then the shared row, and in a unit of this rank's own token (phase 2) last its
// residual_in row, which the reduction adds after the peer's partial has arrived. A route whose row
// is out of range gets no copy: its stage's barrier is arrived on without bytes, and the reader
// adds zero, as partial_vector does.

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

// This rank's partial of token t from the ring, one row at a time: partial_vector's additions in
// its order, in fp32 (so the same bits), rounded once to the dtype for the exchange.
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
    if (row >= p.rows && threadIdx.x == 0) ++bad_rows;  // a route: nvec 16-byte loads (finish_call's unit)
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

}  // namespace moe_ar
