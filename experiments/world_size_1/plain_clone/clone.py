"""The Triton kernel's plain tail written as a small stand-alone CUDA kernel (NVRTC through CuPy), timed
beside the Triton kernel and our program: is the large-T gap in how the row is computed, or in what
our program carries around it? H 7168, top_k 8 + shared, bf16, fp32 router weights, plain.

Arms (one token a block, natural order: each route's index, weight and loads, then its additions;
then shared, residual, residual_out, the sum of squares, norm_out):
  g256 / g224: a grid of T blocks of 256 (the Triton kernel's 8 warps, a fourth vector half masked)
               or 224 threads (the row exactly, our streaming program's);
  p256 / p224: a grid of the resident blocks (two a multiprocessor), each striding over the tokens;
  p224_res_first, p224_pairs, p224_sum3: p224 with one feature of our streaming program (the shared
               and residual rows first; routes two at a time in a rolled loop; three barriers a row);
  p224_all3: all three.
Each arm's outputs are checked against the Triton kernel's first (residual_out the same bits,
norm_out within one bf16 ulp). Cold: input sets rotated through more than 3x the L2; warm: one set.

    python experiments/world_size_1/plain_clone/clone.py OUT_JSON
"""
from __future__ import annotations

import json
import math
import pathlib
import sys

import cupy
import numpy as np
import torch
from cupy.cuda import function

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import dispatch  # noqa: E402
from dispatch import registry  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "mid_tokens"))
import ncu_probe  # noqa: E402
from moe_ar_tools.baselines import triton_fused as tf  # noqa: E402

from ncu_probe import DT, EPS, H, K, RSF  # noqa: E402  (the inputs' shape and constants)

SOURCE = r'''
#include <cuda_bf16.h>
__device__ __forceinline__ void fma8(float (&acc)[8], float s, const uint4& q) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] = fmaf(s, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(s, f.y, acc[2 * i + 1]);
  }
}
// kResFirst: the shared and residual rows loaded before the routes (our streaming program's order);
// kPairs: the routes two at a time in a loop that is not unrolled (its structure); kSum3: its block_sum
// (three barriers a row) instead of one barrier with the warp sums double-buffered.
template <bool kPlain>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if (!kPlain) return *p;
  uint4 q;  // ld.global without .nc, as the Triton kernel's loads
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w) : "l"(p));
  return q;
}
template <int NT, bool kResFirst, bool kPairs, bool kSum3, bool kPlain = false, bool kIdxFirst = false>
__device__ __forceinline__ void clone_row(
    const __nv_bfloat16* __restrict__ x, const int* __restrict__ idx, const float* __restrict__ w,
    const __nv_bfloat16* __restrict__ shared, const __nv_bfloat16* __restrict__ res_in,
    const __nv_bfloat16* __restrict__ gamma, __nv_bfloat16* __restrict__ res_out,
    __nv_bfloat16* __restrict__ norm_out, int T, int rows, float rsf, float eps) {
  constexpr int H = 7168, K = 8, NV = H / 8, VPT = (NV + NT - 1) / NT, NW = NT / 32;
  __shared__ float red[2][NW];
  __shared__ float red_total;
  int parity = 0;
  for (int t = blockIdx.x; t < T; t += gridDim.x, parity ^= 1) {
    const uint4* sh = reinterpret_cast<const uint4*>(shared + (long long)t * H);
    const uint4* rs = reinterpret_cast<const uint4*>(res_in + (long long)t * H);
    uint4 a_sh[VPT], a_rs[VPT];
    int rows_k[K];
    float s_k[K];
    if (kIdxFirst) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        rows_k[k] = idx[(long long)t * K + k];
        s_k[k] = w[(long long)t * K + k];
      }
    }
    if (kResFirst) {
#pragma unroll
      for (int r = 0; r < VPT; ++r) {
        const int v = r * NT + threadIdx.x;
        a_sh[r] = v < NV ? load16<kPlain>(sh + v) : make_uint4(0, 0, 0, 0);
        a_rs[r] = v < NV ? load16<kPlain>(rs + v) : make_uint4(0, 0, 0, 0);
      }
    }
    float acc[VPT][8];
#pragma unroll
    for (int r = 0; r < VPT; ++r)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
    if (kPairs) {
#pragma unroll 1
      for (int k0 = 0; k0 < K; k0 += 2) {
        const uint4* src[2];
        float s[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          int row = idx[(long long)t * K + k0 + j];
          s[j] = w[(long long)t * K + k0 + j];
          const bool ok = row >= 0 && row < rows;
          s[j] = ok ? s[j] : 0.f;
          src[j] = reinterpret_cast<const uint4*>(x + (long long)(ok ? row : 0) * H);
        }
        uint4 q[VPT][2];
#pragma unroll
        for (int r = 0; r < VPT; ++r)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int v = r * NT + threadIdx.x;
            q[r][j] = v < NV ? src[j][v] : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
        for (int r = 0; r < VPT; ++r)
#pragma unroll
          for (int j = 0; j < 2; ++j) fma8(acc[r], s[j], q[r][j]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        int row = kIdxFirst ? rows_k[k] : idx[(long long)t * K + k];
        float s = kIdxFirst ? s_k[k] : w[(long long)t * K + k];
        const bool ok = row >= 0 && row < rows;
        s = ok ? s : 0.f;
        row = ok ? row : 0;
        const uint4* src = reinterpret_cast<const uint4*>(x + (long long)row * H);
#pragma unroll
        for (int r = 0; r < VPT; ++r) {
          const int v = r * NT + threadIdx.x;
          if (v < NV) {
            const uint4 q = load16<kPlain>(src + v);  // one 16-byte load (through the reference, the compiler loads 4-byte words)
            fma8(acc[r], s, q);
          }
        }
      }
    }
    uint4 out[VPT];
    float sq = 0.f;
#pragma unroll
    for (int r = 0; r < VPT; ++r) {
      const int v = r * NT + threadIdx.x;
      out[r] = make_uint4(0, 0, 0, 0);
      if (v < NV) {
        const uint4 a = kResFirst ? a_sh[r] : sh[v], b = kResFirst ? a_rs[r] : rs[v];
        const __nv_bfloat162* ha = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* hb = reinterpret_cast<const __nv_bfloat162*>(&b);
        __nv_bfloat162* ho = reinterpret_cast<__nv_bfloat162*>(&out[r]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 fa = __bfloat1622float2(ha[i]), fb = __bfloat1622float2(hb[i]);
          const float y0 = acc[r][2 * i] * rsf + fa.x + fb.x, y1 = acc[r][2 * i + 1] * rsf + fa.y + fb.y;
          ho[i] = __floats2bfloat162_rn(y0, y1);
          const float2 z = __bfloat1622float2(ho[i]);
          sq = fmaf(z.x, z.x, sq);
          sq = fmaf(z.y, z.y, sq);
        }
        reinterpret_cast<uint4*>(res_out + (long long)t * H)[v] = out[r];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    float total = 0.f;
    if (kSum3) {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      if (lane == 0) red[0][warp] = sq;
      __syncthreads();
      if (warp == 0) {
        float y = lane < NW ? red[0][lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
        if (lane == 0) red_total = y;
      }
      __syncthreads();
      total = red_total;
      __syncthreads();
    } else {
      if (threadIdx.x % 32 == 0) red[parity][threadIdx.x / 32] = sq;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < NW; ++i) total += red[parity][i];
    }
    const float rstd = rsqrtf(__fdiv_rn(total, (float)H) + eps);
    const uint4* gm = reinterpret_cast<const uint4*>(gamma);
#pragma unroll
    for (int r = 0; r < VPT; ++r) {
      const int v = r * NT + threadIdx.x;
      if (v < NV) {
        const uint4 g = gm[v];
        const __nv_bfloat162* hg = reinterpret_cast<const __nv_bfloat162*>(&g);
        const __nv_bfloat162* ho = reinterpret_cast<const __nv_bfloat162*>(&out[r]);
        uint4 n;
        __nv_bfloat162* hn = reinterpret_cast<__nv_bfloat162*>(&n);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 fo = __bfloat1622float2(ho[i]), fg = __bfloat1622float2(hg[i]);
          hn[i] = __floats2bfloat162_rn((fo.x * rstd) * fg.x, (fo.y * rstd) * fg.y);
        }
        reinterpret_cast<uint4*>(norm_out + (long long)t * H)[v] = n;
      }
    }
  }
}
#define ENTRY(NAME, NT, A, B, C) extern "C" __global__ void __launch_bounds__(NT, 2) clone_##NAME( \
    const __nv_bfloat16* x, const int* idx, const float* w, const __nv_bfloat16* shared, \
    const __nv_bfloat16* res_in, const __nv_bfloat16* gamma, __nv_bfloat16* res_out, __nv_bfloat16* norm_out, \
    int T, int rows, float rsf, float eps) { \
  clone_row<NT, A, B, C>(x, idx, w, shared, res_in, gamma, res_out, norm_out, T, rows, rsf, eps); }
ENTRY(n256, 256, false, false, false)
ENTRY(n224, 224, false, false, false)
ENTRY(res_first, 224, true, false, false)
ENTRY(pairs, 224, false, true, false)
ENTRY(sum3, 224, false, false, true)
ENTRY(all3, 224, true, true, true)
'''

# arm: (entry, threads, persistent grid)
ARMS = {"g256": ("n256", 256, False), "g224": ("n224", 224, False), "p256": ("n256", 256, True),
        "p224": ("n224", 224, True), "p224_res_first": ("res_first", 224, True), "p224_pairs": ("pairs", 224, True),
        "p224_sum3": ("sum3", 224, True), "p224_all3": ("all3", 224, True)}


def inputs(T, seed):
    """One input set (../mid_tokens/ncu_probe.py's, seeded) with its two outputs."""
    x = ncu_probe.inputs(T, seed)
    return dict(x, residual_out=torch.empty(T, H, dtype=DT, device="cuda"),
                norm_out=torch.empty(T, H, dtype=DT, device="cuda"))


def call_triton(s):
    """The Triton kernel (num_warps 8) on input set s."""
    tf.fused({"residual_out": s["residual_out"], "norm_out": s["norm_out"]}, s["allreduce_in"], s["idx"], s["scale"],
             s["shared"], s["residual"], s["gamma"], eps=EPS, routed_scaling_factor=RSF, num_warps=8)


def call_ours(ws, s):
    """Our automatic choice on input set s."""
    dispatch.moe_finalize_allreduce(
        ws, allreduce_in=s["allreduce_in"], expanded_idx_to_permuted_idx=s["idx"], residual_in=s["residual"],
        norm_weight=s["gamma"], expert_scale_factor=s["scale"], routed_scaling_factor=RSF,
        shared_expert_output=s["shared"], eps=EPS, residual_out=s["residual_out"], norm_out=s["norm_out"])


def main(out_path, source=SOURCE, arms=ARMS, tokens=(256, 1024, 2048, 8192), extra=None):
    """Times `arms` (name: (entry, threads, persistent grid)) of `source` beside the Triton kernel and ours;
    `extra(T)`, where given, returns more arms for T tokens: {name: call(input set)}."""
    # our programs' compiler and options (dispatch.registry), loaded as they are
    cubin, log = registry.compile_cubin(source, "clone", "sm_90a")
    module = function.Module()
    module.load(cubin)
    kernels = {n: module.get_function(f"clone_{entry}") for n, (entry, _, _) in arms.items()}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    result = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "l2": l2, "rows": []}
    result["ptxas"] = log if isinstance(log, str) else log.decode()
    print(result, flush=True)
    for T in tokens:
        set_bytes = T * (K + 4) * H * 2
        n_cold = max(2, math.ceil(3 * l2 / set_bytes) + 1)
        sets = [inputs(T, 1000 * T + i) for i in range(n_cold)]
        ws = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=DT)
        more = extra(T) if extra else {}

        def call(arm, s):
            if arm in more:
                more[arm](s)
            elif arm == "triton":
                call_triton(s)
            elif arm == "ours":
                call_ours(ws, s)
            else:
                _, nt, persist = arms[arm]
                grid = min(T, 2 * sms) if persist else T
                stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
                ptrs = [np.uint64(s[n].data_ptr()) for n in ("allreduce_in", "idx", "scale", "shared", "residual",
                                                              "gamma", "residual_out", "norm_out")]
                kernels[arm]((grid, 1, 1), (nt, 1, 1), (*ptrs, np.int32(T), np.int32(T * K), np.float32(RSF),
                                                        np.float32(EPS)), stream=stream)

        names = ["triton", "ours", *arms, *more]
        # outputs: every arm against the Triton kernel's (poisoned first)
        s = sets[0]
        call("triton", s)
        torch.cuda.synchronize()
        want_r, want_n = s["residual_out"].clone(), s["norm_out"].clone()
        checks = {}
        for arm in names[1:]:
            s["residual_out"].fill_(float("nan"))
            s["norm_out"].fill_(float("nan"))
            call(arm, s)
            torch.cuda.synchronize()
            same_r = torch.equal(s["residual_out"].view(torch.int16), want_r.view(torch.int16))
            ulp = (s["norm_out"].view(torch.int16).int() - want_n.view(torch.int16).int()).abs().max().item()
            checks[arm] = {"residual_out_same_bits": same_r, "norm_out_max_ulp": ulp}
        print(T, checks, flush=True)
        graphs = {}
        for mode in ("cold", "warm"):
            use = sets if mode == "cold" else sets[:1]
            calls = max(20, len(use) * 2) if mode == "cold" else 20
            for arm in names:
                for s in use:
                    call(arm, s)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for c in range(calls):
                        call(arm, use[c % len(use)])
                graphs[(mode, arm)] = (g, calls)
        times = {key: [] for key in graphs}
        for _ in range(5):  # rounds: every arm once, interleaved
            for key, (g, calls) in graphs.items():
                g.replay()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(3):
                    g.replay()
                b.record()
                torch.cuda.synchronize()
                times[key].append(a.elapsed_time(b) * 1000 / (3 * calls))
        for (mode, arm), ts in times.items():
            ts.sort()
            result["rows"].append({"tokens": T, "mode": mode, "arm": arm, "us": ts[len(ts) // 2], "all_us": ts,
                                   "check": checks.get(arm)})
        line = " ".join(f"{arm} {sorted(times[('cold', arm)])[2]:.2f}/{sorted(times[('warm', arm)])[2]:.2f}" for arm in names)
        print(f"T {T} cold/warm us: {line}", flush=True)
        del graphs, sets, more
        ws.close()
        torch.cuda.empty_cache()
    pathlib.Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
