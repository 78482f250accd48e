// The sums of squares of a token row for its RMSNorm.
// - block_sum (the exchanges' and world size 1's streaming program's): deterministic for a given block
//   size, so every rank computes the same bits for a row.
// - row_sum_of_squares (world size 1's latency program): one order whatever the row's split into
//   threads, blocks or a cluster, so its cluster and one-block layouts give a token the same bits.
//   Each 16-byte vector's squares from +0.0 in element order; the vectors of each group of 32
//   (32g .. 32g + 31) added by a butterfly over the index's bits, from the highest; group g and g + 32
//   added, and the results by the same butterfly. Every layout puts vector r * threads + thread in
//   the thread's r-th register, threads a multiple of 32, so a group is one warp's register r: each
//   layout performs the same additions (fp32 addition is commutative), only on other lanes.
#pragma once
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

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

// The squares of vector r of each thread, summed over the thread's warp for every r < kN at once
// (kN a power of two, <= 32): each butterfly step halves the values a lane keeps, so the kN sums take
// kN - 1 + log2(32 / kN) shuffles, not 5 * kN; each sum's additions are those of its own butterfly.
// Returns the sum of value r on lanes (r << (5 - log2 kN)), the only ones that should use it.
template <int kN>
__device__ __forceinline__ float warp_group_sums(float (&v)[kN]) {
  static_assert(kN >= 1 && kN <= 32 && (kN & (kN - 1)) == 0, "kN: a power of two up to 32");
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = kN, o = 16; n > 1; n /= 2, o /= 2) {
    const bool upper = lane & o;  // keeps values n/2 .. n-1 of those it holds, sends the lower half
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float keep = upper ? v[i + n / 2] : v[i], send = upper ? v[i] : v[i + n / 2];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float x = v[0];
#pragma unroll
  for (int o = 16 / kN; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The values a thread sums squares into, one a vector it holds: a power of two >= the row's vectors
// a thread (kMaxVecPerThread unless the program was built for one shape, shape.cuh).
#ifdef MOE_AR_FIXED_VEC_PER_THREAD
constexpr int kRowVecs = MOE_AR_FIXED_VEC_PER_THREAD;
#else
constexpr int kRowVecs = kMaxVecPerThread;
#endif
static_assert(kRowVecs >= 1 && kRowVecs <= 4, "1 to 4 vectors a thread");
constexpr int kRowSumValues = kRowVecs <= 1 ? 1 : kRowVecs <= 2 ? 2 : 4;

// Each of the thread's group sums (sq[r], the squares of its vector r, zero past the row) added
// over its warp: where the lane holds one, its group's index in the row and true.
template <int kN>
__device__ __forceinline__ bool group_sum_of(float (&sq)[kN], RowPlace place, float& sum, int& group) {
  constexpr int kShift = kN == 1 ? 5 : kN == 2 ? 4 : kN == 4 ? 3 : kN == 8 ? 2 : kN == 16 ? 1 : 0;
  const int lane = place.thread % 32;
  sum = warp_group_sums<kN>(sq);
  const int r = lane >> kShift;
  group = r * (place.threads / 32) + place.thread / 32;
  return (lane & ((1 << kShift) - 1)) == 0;
}

// The row's total from its group sums (groups >= ngroups read as zero), on every lane of the warp.
__device__ __forceinline__ float add_group_sums(const float* groups, int ngroups) {
  const int lane = threadIdx.x % 32;
  float y = (lane < ngroups ? groups[lane] : 0.f) + (lane + 32 < ngroups ? groups[lane + 32] : 0.f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
  return y;
}

// The row's sum of squares in one block (sq[r]: the squares of the thread's vector r, zero past the
// row; nvec: the row's vectors). Three barriers; the block's shared words are reused by the next row.
template <int kN>
__device__ __forceinline__ float row_sum_of_squares(float (&sq)[kN], RowPlace place, int nvec) {
  __shared__ float groups[kMaxThreads * kMaxVecPerThread / 32];  // the row's groups of 32 vectors
  __shared__ float total;
  const int ngroups = (nvec + 31) / 32;
  float sum;
  int group;
  if (group_sum_of<kN>(sq, place, sum, group) && group < ngroups) groups[group] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    const float y = add_group_sums(groups, ngroups);
    if (threadIdx.x == 0) total = y;
  }
  __syncthreads();
  const float r = total;
  __syncthreads();  // total and groups are reused by the next row
  return r;
}

// ---- a row over the blocks of a thread-block cluster (world size 1's cluster layout) ----------
__device__ __forceinline__ unsigned cluster_blocks() {
  unsigned n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}
__device__ __forceinline__ unsigned block_in_cluster() {
  unsigned r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every block of the cluster has started (its shared memory exists): arrive at the kernel's start,
// wait before the first store into another block's shared memory.
__device__ __forceinline__ void cluster_arrive_started() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_started() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// The mbarrier on which a block of the cluster layout counts the bytes of the row's warp sums that
// the cluster's blocks send it (cluster_row_sum_of_squares). One a block, used once a kernel (phase 0).
__device__ __forceinline__ unsigned cluster_sum_barrier() {
  __shared__ alignas(8) unsigned long long barrier;
  return smem_address(&barrier);
}
// At the kernel's start, before cluster_arrive_started: the barrier initialized (one arrival, thread
// 0's expect_tx) and the initialization made visible to the cluster.
__device__ __forceinline__ void cluster_sum_init() {
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(cluster_sum_barrier()) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

// row_sum_of_squares of a row held by the blocks of a cluster (place: the thread's place in the row,
// whole warps in each block): each group sum goes to every block of the cluster, at its group's place,
// with st.async, each block waiting on its own mbarrier for all the row's groups; then each block adds
// them as row_sum_of_squares does: the same bits. No cluster-wide release barrier: that waits for the
// block's outstanding global stores (MEMBAR.ALL.GPU), which measured slower
// (bench_results/world_size_1/late_store/). Once a kernel: the cluster's blocks ran cluster_sum_init
// and cluster_arrive_started.
template <int kN>
__device__ __forceinline__ float cluster_row_sum_of_squares(float (&sq)[kN], RowPlace place, int nvec) {
  __shared__ float groups[kMaxThreads * kMaxVecPerThread / 32];  // the row's groups of 32 vectors
  __shared__ float total;
  const unsigned C = cluster_blocks();
  const int ngroups = (nvec + 31) / 32;
  const unsigned barrier = cluster_sum_barrier();
  if (threadIdx.x == 0)  // the bytes this block receives (their sends may come first: tx-count goes below 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(ngroups * 4u)
                 : "memory");
  float sum;
  int group;
  const bool holds = group_sum_of<kN>(sq, place, sum, group) && group < ngroups;
  cluster_wait_started();  // every block's barrier is initialized
  if (holds) {
    const unsigned local = smem_address(groups + group);
    for (unsigned b = 0; b < C; ++b) {
      unsigned remote, remote_barrier;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(b));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_barrier) : "r"(barrier), "r"(b));
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
                   "r"(__float_as_uint(sum)), "r"(remote_barrier)
                   : "memory");
    }
  }
  if (threadIdx.x < 32) {
    unsigned done = 0;
    while (!done)  // phase 0 completes when every group sum of the row has landed here
      asm volatile(
          "{\n\t.reg .pred q;\n\tmbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0;\n\tselp.u32 %0, 1, 0, q;\n\t}"
          : "=r"(done)
          : "r"(barrier)
          : "memory");
    const float y = add_group_sums(groups, ngroups);
    if (threadIdx.x == 0) total = y;
  }
  __syncthreads();
  return total;
}

}  // namespace moe_ar
