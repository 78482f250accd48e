// The plain tail at T tokens stripped to its dependent chain (bf16, top_k 8, a shared row): a token's 8
// indices and weights, then its 8 routed rows with the shared and residual rows, residual_out, the row's
// sum of squares, norm_out. No checks, no state words, no general shapes: H / 8 vectors split exactly
// over C blocks of a cluster (the sum of squares through distributed shared memory), V vectors a thread.
// floor_cC_vV_nN: N = 1 the whole tail; N = 0 stops after residual_out (the chain without the norm); N = 2
// stores residual_out twice, to both outputs (the op's bytes moved, without the sum of squares).
#include <cuda_bf16.h>

// Loads the compiler keeps in program order (as written, every load of a step before its first use).
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int load_int(const int* p) {
  int v; asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ float load_float(const float* p) {
  float v; asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory"); return v;
}

template <int C, int V, int N>
__device__ __forceinline__ void tail(const __nv_bfloat16* __restrict__ rows, const int* __restrict__ idx,
                                     const float* __restrict__ scale, const __nv_bfloat16* __restrict__ shared,
                                     const __nv_bfloat16* __restrict__ resid, const __nv_bfloat16* __restrict__ gamma,
                                     __nv_bfloat16* __restrict__ res_out, __nv_bfloat16* __restrict__ norm_out, int H,
                                     float rsf, float eps) {
  __shared__ float warp_sums[32];
  __shared__ float block_sum;
  const int t = blockIdx.x / C, crank = blockIdx.x % C;  // a cluster is C consecutive blocks
  const int per_block = H / 8 / C;
  const long long row0 = (long long)t * H;
  int route[8]; float w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) { route[k] = load_int(idx + t * 8 + k); w[k] = load_float(scale + t * 8 + k); }
  uint4 rv[V], sv[V], gv[V], xv[V][8];
#pragma unroll
  for (int r = 0; r < V; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    rv[r] = load16(reinterpret_cast<const uint4*>(resid + row0) + v);
    sv[r] = load16(reinterpret_cast<const uint4*>(shared + row0) + v);
    if (N == 1) gv[r] = load16(reinterpret_cast<const uint4*>(gamma) + v);
  }
#pragma unroll
  for (int r = 0; r < V; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
#pragma unroll
    for (int k = 0; k < 8; ++k) xv[r][k] = load16(reinterpret_cast<const uint4*>(rows + (long long)route[k] * H) + v);
  }
  float y[V][8]; float ss = 0.f;
#pragma unroll
  for (int r = 0; r < V; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&xv[r][k]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        acc[2 * i] = fmaf(w[k], f.x, acc[2 * i]); acc[2 * i + 1] = fmaf(w[k], f.y, acc[2 * i + 1]);
      }
    }
    const __nv_bfloat162* hs = reinterpret_cast<const __nv_bfloat162*>(&sv[r]);
    const __nv_bfloat162* hr = reinterpret_cast<const __nv_bfloat162*>(&rv[r]);
    uint4 o; __nv_bfloat162* ho = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 s = __bfloat1622float2(hs[i]), q = __bfloat1622float2(hr[i]);
      ho[i] = __floats2bfloat162_rn(fmaf(acc[2 * i], rsf, s.x) + q.x, fmaf(acc[2 * i + 1], rsf, s.y) + q.y);
      const float2 back = __bfloat1622float2(ho[i]);
      y[r][2 * i] = back.x; y[r][2 * i + 1] = back.y;
      ss = fmaf(back.x, back.x, ss); ss = fmaf(back.y, back.y, ss);
    }
    reinterpret_cast<uint4*>(res_out + row0)[v] = o;
    if (N == 2) reinterpret_cast<uint4*>(norm_out + row0)[v] = o;  // the op's bytes, no sum of squares
  }
  if (N != 1) return;
  // the block's last warp may be partial (112 threads: 3 warps and 16 threads; a power of two)
  const int lanes = min(32, (int)blockDim.x - (int)(threadIdx.x & ~31u));
  const unsigned mask = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
#pragma unroll
  for (int m = 16; m; m >>= 1)
    if (m < lanes) ss += __shfl_xor_sync(mask, ss, m);
  const int warps = (blockDim.x + 31) / 32;
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int i = 0; i < warps; ++i) tot += warp_sums[i];
  if (C > 1) {
    if (threadIdx.x == 0) block_sum = tot;
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    tot = 0.f;
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&block_sum));
#pragma unroll
    for (int c = 0; c < C; ++c) {
      unsigned remote; float x;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(c));
      asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(remote) : "memory");
      tot += x;
    }
  }
  const float inv = rsqrtf(tot / H + eps);
#pragma unroll
  for (int r = 0; r < V; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    const __nv_bfloat162* hg = reinterpret_cast<const __nv_bfloat162*>(&gv[r]);
    uint4 o; __nv_bfloat162* ho = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 g = __bfloat1622float2(hg[i]);
      ho[i] = __floats2bfloat162_rn(y[r][2 * i] * inv * g.x, y[r][2 * i + 1] * inv * g.y);
    }
    reinterpret_cast<uint4*>(norm_out + row0)[v] = o;
  }
  // no block of the cluster leaves while another may still read its block_sum
  if (C > 1) asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

#define FLOOR(C, V, N)                                                                                           \
  extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(448, 1) floor_c##C##_v##V##_n##N(                               \
      const __nv_bfloat16* rows, const int* idx, const float* scale, const __nv_bfloat16* shared,                \
      const __nv_bfloat16* resid, const __nv_bfloat16* gamma, __nv_bfloat16* res_out, __nv_bfloat16* norm_out,   \
      int H, float rsf, float eps) {                                                                             \
    tail<C, V, N>(rows, idx, scale, shared, resid, gamma, res_out, norm_out, H, rsf, eps);                       \
  }

FLOOR(1, 2, 1)
FLOOR(1, 2, 0)
FLOOR(4, 1, 1)
FLOOR(8, 1, 1)
FLOOR(8, 1, 0)
FLOOR(1, 2, 2)
FLOOR(7, 2, 1)
FLOOR(7, 1, 1)
