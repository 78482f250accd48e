"""Experiment: what one token of the plain tail costs at its floor, graph replay of 10 back-to-back calls.
A prototype of the plain op (H 7168, top_k 8, shared, bf16) split over a cluster of C blocks (sum of
squares through distributed shared memory), against an empty kernel and our `local` program."""
import json, os, sys, statistics
import torch, cupy as cp
import dispatch

SRC = r'''
#include <cuda_bf16.h>
extern "C" __global__ void empty_kernel() {}

template <int C, int VPT>
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
#define PROBE(C, VPT) \
extern "C" __global__ void __cluster_dims__(C, 1, 1) tail_c##C##_v##VPT(const __nv_bfloat16* rows, const int* idx, const float* scale, \
   const __nv_bfloat16* shared, const __nv_bfloat16* resid, const __nv_bfloat16* gamma, __nv_bfloat16* res_out, \
   __nv_bfloat16* norm_out, int H) { tail<C, VPT>(rows, idx, scale, shared, resid, gamma, res_out, norm_out, H); }
PROBE(1, 2)
PROBE(1, 1)
PROBE(2, 1)
PROBE(4, 1)
PROBE(8, 1)

'''
out = os.environ["OUT"]
H, K = 7168, 8
dev = torch.device("cuda")
from moe_ar_common import cuda_env
mod = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90a", "-I" + cuda_env.include_dir()))
res = {}

def sets(n, seed=0):
    g = torch.Generator(device=dev); g.manual_seed(seed)
    S = []
    for i in range(n):
        rows = (0.5 * torch.randn(K, H, generator=g, device=dev)).to(torch.bfloat16)
        idx = torch.randperm(K, generator=g, device=dev).to(torch.int32)
        sc = torch.rand(K, generator=g, device=dev) + 0.05; sc /= sc.sum()
        sh = (0.5 * torch.randn(1, H, generator=g, device=dev)).to(torch.bfloat16)
        rs = torch.randn(1, H, generator=g, device=dev).to(torch.bfloat16)
        gm = (1 + 0.1 * torch.randn(H, generator=g, device=dev)).to(torch.bfloat16)
        S.append((rows, idx, sc, sh, rs, gm, torch.empty(1, H, device=dev, dtype=torch.bfloat16), torch.empty(1, H, device=dev, dtype=torch.bfloat16)))
    return S

def ref(s):
    rows, idx, sc, sh, rs, gm = [x for x in s[:6]]
    p = (rows[idx.long()].double() * sc.double()[:, None]).sum(0) * 2.5 + sh.double()[0] + rs.double()[0]
    r = p.to(torch.bfloat16)
    y = r.double() * torch.rsqrt((r.double() ** 2).mean() + 1e-6) * gm.double()
    return r, y

def timed(launch, n_sets, calls, reps=50):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3): launch(i % n_sets)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                for i in range(calls): launch(i % n_sets)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(ts)

empty = mod.get_function("empty_kernel")
for label, n_sets, calls in (("warm", 10, 10), ("cold", 640, 640)):
    S = sets(n_sets)
    r = {"empty": timed(lambda i: empty((1,), (32,), ()), n_sets, calls)}
    for C, VPT in ((1, 2), (1, 1), (2, 1), (4, 1), (8, 1)):
        try:
            f = mod.get_function(f"tail_c{C}_v{VPT}")
            threads = 896 // (C * VPT)
            def launch(i, f=f, threads=threads, C=C):
                rows, idx, sc, sh, rs, gm, ro, no = S[i]
                f((C,), (threads,), tuple(cp.uint64(x.data_ptr()) for x in (rows, idx, sc, sh, rs, gm, ro, no)) + (cp.int32(H),))
            ok = True
            for i in range(3):
                S[i][6].fill_(float("nan")); S[i][7].fill_(float("nan"))
                launch(i); torch.cuda.synchronize()
                rr, yy = ref(S[i])
                ok &= float(((S[i][6][0].double() - rr.double()).abs()).max()) < 0.1 and float(((S[i][7][0].double() - yy).abs() / yy.abs().clamp_min(1e-3)).max()) < 2e-2
            r[f"cluster{C}_vpt{VPT}"] = {"us": timed(launch, n_sets, calls), "ok": ok}
        except Exception as e:
            r[f"cluster{C}_vpt{VPT}"] = {"error": str(e)[:200]}
    # our program, plain, T=1, same sets
    ws = dispatch.LocalWorkspace(max_tokens=16, hidden=H, dtype=torch.bfloat16)
    outs = [(torch.empty(1, H, device=dev, dtype=torch.bfloat16), torch.empty(1, H, device=dev, dtype=torch.bfloat16)) for _ in range(n_sets)]
    for pdl in (False, True):
        def ours(i, pdl=pdl):
            rows, idx, sc, sh, rs, gm, _, _ = S[i]
            try:
                dispatch.moe_finalize_allreduce(ws, allreduce_in=rows, expanded_idx_to_permuted_idx=idx.view(1, K),
                    residual_in=rs, norm_weight=gm, expert_scale_factor=sc.view(1, K), routed_scaling_factor=2.5,
                    shared_expert_output=sh, eps=1e-6, residual_out=outs[i][0], norm_out=outs[i][1], launch_with_pdl=pdl)
            except TypeError:
                dispatch.moe_finalize_allreduce(ws, allreduce_in=rows, expanded_idx_to_permuted_idx=idx.view(1, K),
                    residual_in=rs, norm_weight=gm, expert_scale_factor=sc.view(1, K), routed_scaling_factor=2.5,
                    shared_expert_output=sh, eps=1e-6, residual_out=outs[i][0], norm_out=outs[i][1])
        try:
            r["ours_pdl" if pdl else "ours"] = timed(ours, n_sets, calls)
        except Exception as e:
            r["ours_pdl" if pdl else "ours"] = {"error": str(e)[:300]}
    res[label] = r
    print(label, json.dumps(r), flush=True)
    del S
    torch.cuda.empty_cache()
json.dump(res, open(f"{out}/floor_probe.json", "w"), indent=1)
