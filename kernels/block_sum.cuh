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

// block_sum of a row held by the C blocks of a cluster in order (block c holds the row's threads
// c * blockDim.x to (c + 1) * blockDim.x - 1, whole warps): each warp's sum goes to every block of
// the cluster, at its warp's place in the row, then each block adds the row's warp sums as
// block_sum does. The same bits as block_sum in one block of C * blockDim.x threads. Once a
// kernel: the cluster's blocks waited for cluster_arrive_started.
__device__ __forceinline__ float cluster_block_sum(float x) {
  __shared__ float warp_sums[kMaxThreads / 32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const unsigned C = cluster_blocks(), warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  cluster_wait_started();
  if (lane == 0) {
    const unsigned local = smem_address(warp_sums + block_in_cluster() * warps + warp);
    for (unsigned b = 0; b < C; ++b) {
      unsigned remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(b));
      asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(x) : "memory");
    }
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (warp == 0) {
    float y = lane < (int)(C * warps) ? warp_sums[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
    if (lane == 0) total = y;
  }
  __syncthreads();
  return total;
}

}  // namespace moe_ar
