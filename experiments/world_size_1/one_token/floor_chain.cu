// The 1-token chain of the plain tail (H 7168, top_k 8, shared, bf16), stripped: indices, rows, sum of squares,
// norm. tail_cC_vV_nN_: a cluster of C blocks, V vectors a thread, N = 0 stops after residual_out (no norm).

#include <cuda_bf16.h>
extern "C" __global__ void empty_kernel() {}

template <int C, int VPT, bool NORM>
__device__ __forceinline__ void tail(const __nv_bfloat16* __restrict__ rows, const int* __restrict__ idx,
                                     const float* __restrict__ scale, const __nv_bfloat16* __restrict__ shared,
                                     const __nv_bfloat16* __restrict__ resid, const __nv_bfloat16* __restrict__ gamma,
                                     __nv_bfloat16* __restrict__ res_out, __nv_bfloat16* __restrict__ norm_out, int H) {
  __shared__ float part[32];
  __shared__ float slots[C > 1 ? 1 : 1];
  unsigned crank = 0;
  if (C > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(crank));
  const int nvec = H / 8, per_block = nvec / C;
  uint4 rv[VPT], sv[VPT], gv[VPT], xv[VPT][8];
  #pragma unroll
  for (int r = 0; r < VPT; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    rv[r] = reinterpret_cast<const uint4*>(resid)[v];
    sv[r] = reinterpret_cast<const uint4*>(shared)[v];
    gv[r] = reinterpret_cast<const uint4*>(gamma)[v];
  }
  int row[8]; float sc[8];
  #pragma unroll
  for (int k = 0; k < 8; ++k) { row[k] = idx[k]; sc[k] = scale[k]; }
  #pragma unroll
  for (int r = 0; r < VPT; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    #pragma unroll
    for (int k = 0; k < 8; ++k) xv[r][k] = reinterpret_cast<const uint4*>(rows + (long long)row[k] * H)[v];
  }
  float y[VPT][8]; float ss = 0.f;
  #pragma unroll
  for (int r = 0; r < VPT; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    float acc[8] = {0,0,0,0,0,0,0,0};
    #pragma unroll
    for (int k = 0; k < 8; ++k) {
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&xv[r][k]);
      #pragma unroll
      for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); acc[2*i] = fmaf(sc[k], f.x, acc[2*i]); acc[2*i+1] = fmaf(sc[k], f.y, acc[2*i+1]); }
    }
    const __nv_bfloat162* hs = reinterpret_cast<const __nv_bfloat162*>(&sv[r]);
    const __nv_bfloat162* hr = reinterpret_cast<const __nv_bfloat162*>(&rv[r]);
    uint4 o; __nv_bfloat162* ho = reinterpret_cast<__nv_bfloat162*>(&o);
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 s = __bfloat1622float2(hs[i]), q = __bfloat1622float2(hr[i]);
      float a = acc[2*i] * 2.5f + s.x + q.x, b = acc[2*i+1] * 2.5f + s.y + q.y;
      ho[i] = __floats2bfloat162_rn(a, b);
      float2 back = __bfloat1622float2(ho[i]); y[r][2*i] = back.x; y[r][2*i+1] = back.y;
      ss = fmaf(back.x, back.x, ss); ss = fmaf(back.y, back.y, ss);
    }
    reinterpret_cast<uint4*>(res_out)[v] = o;
  }
  if (!NORM) return;
  if (threadIdx.x < 32) part[threadIdx.x] = 0.f;
  __syncthreads();
  atomicAdd(&part[threadIdx.x & 31], ss);
  __syncthreads();
  float tot = 0.f;
  #pragma unroll
  for (int w = 0; w < 32; ++w) tot += part[w];
  if (C > 1) {
    if (threadIdx.x == 0) slots[0] = tot;
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    tot = 0.f;
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&slots[0]));
    #pragma unroll
    for (int c = 0; c < C; ++c) {
      unsigned remote; float x;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(c));
      asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(remote) : "memory");
      tot += x;
    }
  }
  const float rms = rsqrtf(tot / H + 1e-6f);
  #pragma unroll
  for (int r = 0; r < VPT; ++r) {
    const int v = crank * per_block + r * blockDim.x + threadIdx.x;
    const __nv_bfloat162* hg = reinterpret_cast<const __nv_bfloat162*>(&gv[r]);
    uint4 o; __nv_bfloat162* ho = reinterpret_cast<__nv_bfloat162*>(&o);
    #pragma unroll
    for (int i = 0; i < 4; ++i) { float2 g = __bfloat1622float2(hg[i]); ho[i] = __floats2bfloat162_rn(y[r][2*i] * rms * g.x, y[r][2*i+1] * rms * g.y); }
    reinterpret_cast<uint4*>(norm_out)[v] = o;
  }
  if (C > 1) asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#define PROBE(C, VPT, N) \
extern "C" __global__ void __cluster_dims__(C, 1, 1) tail_c##C##_v##VPT##_n##N##_(const __nv_bfloat16* rows, const int* idx, const float* scale, \
   const __nv_bfloat16* shared, const __nv_bfloat16* resid, const __nv_bfloat16* gamma, __nv_bfloat16* res_out, \
   __nv_bfloat16* norm_out, int H) { tail<C, VPT, N>(rows, idx, scale, shared, resid, gamma, res_out, norm_out, H); }

PROBE(1, 2, 1)
PROBE(1, 2, 0)
PROBE(8, 1, 1)
PROBE(8, 1, 0)
PROBE(4, 1, 1)
