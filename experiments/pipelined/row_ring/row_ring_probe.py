"""Probe behind the pipelined two-shot's row ring (bench_results/pipelined/row_ring/): the partials
alone (K routed rows + the shared row of each token summed, H 7168 bf16, top_k 8, one GPU), read two
ways at several blocks a multiprocessor, against a device copy of the same number of bytes:

  reg_reduce     16-byte register loads, four routes at a time (as the template's partial_vector)
  tma_reduce_N   a ring of N rows in shared memory filled by cp.async.bulk (as the template's RowRing)

    OUT=. python3 experiments/pipelined/row_ring/row_ring_probe.py     # writes $OUT/row_ring_probe.json

A tool, not a test; it needs a GPU of sm_90 or later. The ring's
output is compared with the register kernel's, bit for bit (`matches_reg`).
"""
import json
import os

import cupy as cp
import numpy as np

SRC = r'''
#include <cuda_bf16.h>

#define KMAXV 4
__device__ __forceinline__ void to_float(uint4 u, float* x) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); x[2*i] = f.x; x[2*i+1] = f.y; }
}
__device__ __forceinline__ uint4 from_float(const float* x) {
  uint4 u; __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(x[2*i], x[2*i+1]);
  return u;
}
extern "C" __global__ void __launch_bounds__(224) reg_reduce(const __nv_bfloat16* in, const int* idx, const float* scale,
    const __nv_bfloat16* shared, __nv_bfloat16* out, int T, int K, int H) {
  const int nvec = H / 8;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float acc[8] = {0,0,0,0,0,0,0,0};
      for (int k0 = 0; k0 < K; k0 += 4) {
        uint4 rows[4]; float sc[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          int row = idx[t * K + k0 + j];
          rows[j] = __ldcs(reinterpret_cast<const uint4*>(in + (long long)row * H) + v);
          sc[j] = scale[t * K + k0 + j];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) { float x[8]; to_float(rows[j], x); for (int i = 0; i < 8; ++i) acc[i] = fmaf(sc[j], x[i], acc[i]); }
      }
      float x[8]; to_float(__ldcs(reinterpret_cast<const uint4*>(shared + (long long)t * H) + v), x);
      for (int i = 0; i < 8; ++i) acc[i] += x[i];
      __stcs(reinterpret_cast<uint4*>(out + (long long)t * H) + v, from_float(acc));
    }
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ bool mbar_try(unsigned a, unsigned phase) {
  unsigned ok;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok) : "r"(a), "r"(phase) : "memory");
  return ok;
}
template <int NS>
__device__ __forceinline__ void tma_body(const __nv_bfloat16* in, const int* idx, const float* scale,
    const __nv_bfloat16* shared, __nv_bfloat16* out, int T, int K, int H, unsigned long long policy) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int rowb = H * 2, nvec = H / 8, G = gridDim.x;
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + NS * rowb);
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bars + s)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int ntok = blockIdx.x < T ? (T - 1 - blockIdx.x) / G + 1 : 0;
  const int nrows = ntok * (K + 1);
  auto issue = [&](int n) {
    const int i = n / (K + 1), k = n % (K + 1), t = blockIdx.x + i * G, s = n % NS;
    const __nv_bfloat16* src = k < K ? in + (long long)idx[t * K + k] * H : shared + (long long)t * H;
    const unsigned bar = smem_addr(bars + s), dst = smem_addr(smem + s * rowb);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(rowb) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(dst), "l"(src), "r"(rowb), "r"(bar), "l"(policy) : "memory");
  };
  if (threadIdx.x == 0) for (int n = 0; n < NS && n < nrows; ++n) issue(n);
  float acc[KMAXV][8];
  for (int r = 0; r < KMAXV; ++r) for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  for (int n = 0; n < nrows; ++n) {
    const int s = n % NS, i = n / (K + 1), k = n % (K + 1), t = blockIdx.x + i * G;
    const float sc = k < K ? scale[t * K + k] : 1.f;
    while (!mbar_try(smem_addr(bars + s), (n / NS) & 1)) {}
    const uint4* stage = reinterpret_cast<const uint4*>(smem + s * rowb);
#pragma unroll
    for (int r = 0; r < KMAXV; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (v < nvec) { float x[8]; to_float(stage[v], x); for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(sc, x[e], acc[r][e]); }
    }
    if (k == K) {
#pragma unroll
      for (int r = 0; r < KMAXV; ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (v < nvec) __stcs(reinterpret_cast<uint4*>(out + (long long)t * H) + v, from_float(acc[r]));
        for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
      }
    }
    __syncthreads();  // every thread is done with stage s
    if (threadIdx.x == 0 && n + NS < nrows) issue(n + NS);
  }
}
#define TMA_KERNEL(NS) \
extern "C" __global__ void __launch_bounds__(224) tma_reduce_##NS(const __nv_bfloat16* in, const int* idx, const float* scale, \
    const __nv_bfloat16* shared, __nv_bfloat16* out, int T, int K, int H, int evict_first) { \
  unsigned long long policy; \
  if (evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy)); \
  else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy)); \
  tma_body<NS>(in, idx, scale, shared, out, T, K, H, policy); }
TMA_KERNEL(2)
TMA_KERNEL(3)
TMA_KERNEL(4)
TMA_KERNEL(6)
'''

def main(out_dir):
    dev = cp.cuda.Device(0)
    sms = dev.attributes["MultiProcessorCount"]
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a", "-std=c++17"))
    H, K = 7168, 8
    result = {"machine": os.uname().nodename, "records": []}
    rng = np.random.default_rng(0)
    for T in (2048, 8192):
        rows = T * K
        cp.random.seed(T)
        in_bf = (cp.random.standard_normal((rows, H), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        sh = (cp.random.standard_normal((T, H), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
        idx = cp.asarray(rng.permutation(rows).astype(np.int32))
        scale = cp.asarray(rng.random(rows, dtype=np.float32))
        out = cp.empty((T, H), cp.uint16)
        nbytes = T * (K + 2) * H * 2
        def time_us(fn, reps=30):
            fn(); cp.cuda.Stream.null.synchronize()
            ts = []
            for _ in range(reps):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(); fn(); end.record(); end.synchronize()
                ts.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
            return float(np.median(ts))
        # reference bandwidth: a copy of the same number of bytes (half read, half write)
        src = cp.empty(nbytes // 2, cp.uint8); dst = cp.empty_like(src)
        copy_us = time_us(lambda: dst.__setitem__(Ellipsis, src))
        result["records"].append({"T": T, "kernel": "copy", "us": copy_us, "TBps": nbytes / copy_us / 1e6})
        reg_out = None
        reg = mod.get_function("reg_reduce")
        for per_sm in (1, 2, 3, 4, 6):
            grid = per_sm * sms
            us = time_us(lambda: reg((grid,), (224,), (in_bf, idx, scale, sh, out, np.int32(T), np.int32(K), np.int32(H))))
            if reg_out is None: reg_out = out.copy()
            result["records"].append({"T": T, "kernel": "reg", "per_sm": per_sm, "us": us, "TBps": nbytes / us / 1e6})
            print(result["records"][-1], flush=True)
        for ring_rows in (2, 3, 4, 6):
            kernel = cp.RawKernel(SRC, f"tma_reduce_{ring_rows}", options=("-arch=sm_90a", "-std=c++17"))
            smem = ring_rows * H * 2 + 8 * ring_rows
            kernel.max_dynamic_shared_size_bytes = smem
            for per_sm in (1, 2, 3, 4):
                if per_sm * (smem + 1024) > 227 * 1024: continue
                for evict_first in (1, 0):
                    grid = per_sm * sms
                    out.fill(0xFFFF)
                    us = time_us(lambda: kernel((grid,), (224,), (in_bf, idx, scale, sh, out, np.int32(T), np.int32(K), np.int32(H), np.int32(evict_first)), shared_mem=smem))
                    same = bool((out == reg_out).all())
                    result["records"].append({"T": T, "kernel": f"tma{ring_rows}", "evict_first": evict_first, "per_sm": per_sm, "us": us,
                                           "TBps": nbytes / us / 1e6, "matches_reg": same})
                    print(result["records"][-1], flush=True)
    with open(os.path.join(out_dir, "row_ring_probe.json"), "w") as fh:
        json.dump(result, fh, indent=1)

if __name__ == "__main__":
    main(os.environ.get("OUT", "."))
