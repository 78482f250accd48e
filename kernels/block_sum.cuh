// The block-wide sum of the RMSNorm's sum of squares: deterministic for a given block size, so every
// rank computes the same bits for a row.
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
// the cluster's blocks send it (cluster_block_sum). One a block, used once a kernel (phase 0).
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

// block_sum of a row held by the C blocks of a cluster in order (block c holds the row's threads
// c * blockDim.x to (c + 1) * blockDim.x - 1, whole warps): each warp's sum goes to every block of
// the cluster, at its warp's place in the row, with st.async, each block waiting on its own mbarrier
// for all C * warps sums; then each block adds the row's warp sums as block_sum does. The same bits
// as block_sum in one block of C * blockDim.x threads. No cluster-wide release barrier: that waits
// for the block's outstanding global stores (MEMBAR.ALL.GPU) and took 0.2-0.6 us a call
// (bench_results/world_size_1/late_store/). Once a kernel: the cluster's blocks ran cluster_sum_init
// and cluster_arrive_started.
__device__ __forceinline__ float cluster_block_sum(float x) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const unsigned C = cluster_blocks(), warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned barrier = cluster_sum_barrier();
  if (threadIdx.x == 0)  // the bytes this block receives (their sends may come first: tx-count goes below 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(C * warps * 4u)
                 : "memory");
  cluster_wait_started();  // every block's barrier is initialized
  if (lane == 0) {
    const unsigned local = smem_address(warp_sums + block_in_cluster() * warps + warp);
    for (unsigned b = 0; b < C; ++b) {
      unsigned remote, remote_barrier;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(b));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_barrier) : "r"(barrier), "r"(b));
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
                   "r"(__float_as_uint(x)), "r"(remote_barrier)
                   : "memory");
    }
  }
  if (warp == 0) {
    unsigned done = 0;
    while (!done)  // phase 0 completes when every warp sum of the row has landed here
      asm volatile(
          "{\n\t.reg .pred q;\n\tmbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0;\n\tselp.u32 %0, 1, 0, q;\n\t}"
          : "=r"(done)
          : "r"(barrier)
          : "memory");
    float y = lane < (int)(C * warps) ? warp_sums[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
    if (lane == 0) total = y;
  }
  __syncthreads();
  return total;
}

}  // namespace moe_ar
