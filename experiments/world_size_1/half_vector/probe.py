"""The plain tail as one bare CUDA kernel, one block a token, with N elements a thread (N = 2, 4, 8,
16: 4-, 8-, 16-byte loads and two 16-byte loads a route), beside ours (the automatic choice) and the
Triton kernel at num_warps 4-32, in one process.

Question: is the Triton kernel's best configuration at rows under 12 warps (4 elements a thread:
8-byte loads, 4x the threads of our two-vector split) faster because of the layout itself or
because of Triton's code? The bare kernel has no state words, checks or PDL: the ratios between its
own N answer the question, and ours against N = 16 (our split) shows what the rest of ours costs.
Plain, bf16, fp32 router weights, no shared expert, every load of a row issued before any is used
(as the latency program's builds), CUDA-graph replay, cold (input sets rotated through more than 3x
the L2) and warm (one set). Each system's outputs for the first set are checked against a float32
reference first (bf16 ulps printed; more than 1 / 2 is flagged INVALID).

    PYTHONPATH=. python experiments/world_size_1/half_vector/probe.py --out DIR [--shapes 2048:8,4096:8]
        [--tokens 32,48,128,256]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import cupy
import numpy
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import dispatch  # noqa: E402
from dispatch import registry  # noqa: E402
from moe_ar_tools.baselines import triton_fused  # noqa: E402
from moe_ar_tools.bench import timing  # noqa: E402
from moe_ar_tools.bench.outputs import alloc_outputs  # noqa: E402

EPS = 1e-6
SOURCE = r"""
#include <cuda_bf16.h>
template <int N> struct alignas(2 * N > 16 ? 16 : 2 * N) Pack { __nv_bfloat16 v[N]; };

template <int K, int N>
__device__ __forceinline__ void tail(const __nv_bfloat16* __restrict__ x, const int* __restrict__ idx,
                                     const float* __restrict__ w, const __nv_bfloat16* __restrict__ res_in,
                                     const __nv_bfloat16* __restrict__ gamma, __nv_bfloat16* __restrict__ res_out,
                                     __nv_bfloat16* __restrict__ norm_out, int H, float eps) {
  __shared__ float part[32];
  __shared__ float total_shared;
  const int t = blockIdx.x, e0 = threadIdx.x * N;
  const bool active = e0 < H;
  int row[K];
  float wk[K];
#pragma unroll
  for (int k = 0; k < K; ++k) { row[k] = idx[t * K + k]; wk[k] = w[t * K + k]; }
  Pack<N> xv[K], rv, gv;
  if (active) {
#pragma unroll
    for (int k = 0; k < K; ++k) xv[k] = *reinterpret_cast<const Pack<N>*>(x + (long long)row[k] * H + e0);
    rv = *reinterpret_cast<const Pack<N>*>(res_in + (long long)t * H + e0);
    gv = *reinterpret_cast<const Pack<N>*>(gamma + e0);
  }
  float sq = 0.f;
  Pack<N> ro;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) acc = fmaf(wk[k], __bfloat162float(xv[k].v[i]), acc);
    ro.v[i] = __float2bfloat16_rn(acc + __bfloat162float(rv.v[i]));
    const float r = __bfloat162float(ro.v[i]);
    sq = fmaf(r, r, sq);
  }
  if (!active) sq = 0.f;
  else *reinterpret_cast<Pack<N>*>(res_out + (long long)t * H + e0) = ro;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) part[warp] = sq;
  __syncthreads();
  if (warp == 0) {
    float s = lane < warps ? part[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) total_shared = s;
  }
  __syncthreads();
  const float rms = rsqrtf(total_shared / (float)H + eps);
  if (!active) return;
  Pack<N> no;
#pragma unroll
  for (int i = 0; i < N; ++i)
    no.v[i] = __float2bfloat16_rn(__bfloat162float(ro.v[i]) * rms * __bfloat162float(gv.v[i]));
  *reinterpret_cast<Pack<N>*>(norm_out + (long long)t * H + e0) = no;
}
"""
ENTRY = """
extern "C" __global__ void __launch_bounds__({B}) tail_k{K}_n{N}(const __nv_bfloat16* x, const int* idx,
    const float* w, const __nv_bfloat16* res_in, const __nv_bfloat16* gamma, __nv_bfloat16* res_out,
    __nv_bfloat16* norm_out, int H, float eps) {{
  tail<{K}, {N}>(x, idx, w, res_in, gamma, res_out, norm_out, H, eps);
}}
"""
ELEMS = (2, 4, 8, 16)
WARPS = (4, 8, 16, 32)
MAX_HIDDEN = 4096


def bound(n):
    """The launch bound of the N-element kernel: its most threads at MAX_HIDDEN (so its registers are
    not capped below what it needs: 1024 threads would cap every N at 64)."""
    return min(1024, MAX_HIDDEN // n)


def kernels(top_ks, target):
    """Every (top_k, N) entry, compiled as the programs are (registry.compile_cubin: NVRTC, the manifest's
    options) for `target`; returns (module, {name: function}, ptxas log); the module must outlive the
    functions."""
    from cupy.cuda import function
    src = SOURCE + "".join(ENTRY.format(K=k, N=n, B=bound(n)) for k in top_ks for n in ELEMS)
    cubin, log = registry.compile_cubin(src, "half_vector", target)
    mod = function.Module()
    mod.load(cubin)
    names = [f"tail_k{k}_n{n}" for k in top_ks for n in ELEMS]
    return mod, {name: mod.get_function(name) for name in names}, log


def make_set(T, H, K, gen):
    R = T * K + 8
    x = torch.randn(R, H, generator=gen, device="cuda").to(torch.bfloat16)
    idx = torch.randperm(R, generator=gen, device="cuda")[: T * K].reshape(T, K).to(torch.int32)
    w = torch.rand(T, K, generator=gen, device="cuda")
    res = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    return dict(x=x, idx=idx, w=w, res=res, res_out=torch.empty_like(res), norm_out=torch.empty_like(res),
                outs=triton_fused.outputs(T, H, torch.bfloat16, None, "cuda"),
                ours=alloc_outputs(T, H, torch.bfloat16, None, "cuda"))


def reference(s, gamma):
    """(residual_out, norm_out) in bf16 from a float32 sum, and each element's magnitude: the sum of
    its terms' magnitudes (the scale of the sum's rounding error where the terms cancel), times the
    norm's factor for norm_out."""
    terms = s["x"].float()[s["idx"].long()] * s["w"].unsqueeze(-1)
    acc = terms.sum(1)
    r = (acc + s["res"].float()).to(torch.bfloat16)
    rf = r.float()
    scale = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
    n = (rf * scale).to(torch.bfloat16)
    magnitude = terms.abs().sum(1) + s["res"].float().abs()
    return (r, magnitude), (n, magnitude * scale.abs())


def max_ulps(a, ref):
    """Largest difference from the reference in bf16 ulps of the larger of the reference value and its
    magnitude (0 = bit-equal): one ulp is a rounding flip; a sum whose terms cancel is judged at its
    terms' scale, not at its small result's (the first run's check was, and flagged such rows)."""
    b, magnitude = ref
    a, b = a.float(), b.float()
    ulp = torch.clamp(torch.maximum(b.abs(), magnitude), min=1e-30).log2().floor().exp2() * 2.0 ** -7
    return float(((a - b).abs() / ulp).max())


def time_graph(launch, sets, calls, reps=30):
    """us a call: a CUDA graph of `calls` launches rotating through `sets`, replayed `reps` times
    (the bench's own capture and replay, moe_ar_tools.bench.timing)."""
    device = torch.device("cuda")
    graph, _, _ = timing.capture_graph(lambda i: launch(sets[i % len(sets)]), calls, (0, 1), device)
    graph.replay()
    ms = timing.timed_replays([graph], reps, 0, device)[0]
    return timing.median(ms) * 1000.0 / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="2048:8,4096:8,4096:2")
    ap.add_argument("--tokens", default="32,48,128,256")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    target = registry.TARGET_FOR_CAPABILITY[torch.cuda.get_device_capability(0)]
    _module, fns, log = kernels(sorted({k for _, k in shapes}), target)
    (out / "ptxas.txt").write_text(log if isinstance(log, str) else log.decode())
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    rows = []
    print(f"{props.name}, L2 {l2 >> 20} MiB")
    for H, K in shapes:
        gamma = (torch.rand(H, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
        ws = dispatch.LocalWorkspace(max_tokens=max(tokens), hidden=H, dtype=torch.bfloat16)
        for T in tokens:
            per_set = (T * K + T * 3) * H * 2  # the rows read, residual_in, the two outputs
            n_cold = max(2, timing.cold_input_sets(per_set, l2))
            sets = [make_set(T, H, K, gen) for _ in range(n_cold)]
            ref_r, ref_n = reference(sets[0], gamma)
            def launch(s):
                dispatch.moe_finalize_allreduce(ws, allreduce_in=s["x"], expanded_idx_to_permuted_idx=s["idx"],
                                                residual_in=s["res"], norm_weight=gamma, expert_scale_factor=s["w"],
                                                eps=EPS, **s["ours"])
            # ours: the automatic choice (the latency program's one-block or cluster layout at these T)
            systems = {"ours": (launch, lambda s: (s["ours"]["residual_out"], s["ours"]["norm_out"]))}
            for n in ELEMS:
                threads = H // n
                if threads > bound(n) or threads < 32 or H % n or H > MAX_HIDDEN:
                    continue
                f = fns[f"tail_k{K}_n{n}"]

                def launch(s, f=f, threads=threads):
                    ptrs = [numpy.uint64(a.data_ptr()) for a in (s["x"], s["idx"], s["w"], s["res"], gamma,
                                                                   s["res_out"], s["norm_out"])]
                    f((T,), (threads,), (*ptrs, numpy.int32(H), numpy.float32(EPS)),
                      stream=cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
                systems[f"bare N={n} ({threads // 32} warps)"] = (launch, lambda s: (s["res_out"], s["norm_out"]))
            for nw in WARPS:
                def launch(s, nw=nw):
                    triton_fused.fused(s["outs"], s["x"], s["idx"], s["w"], None, s["res"], gamma, eps=EPS,
                                       num_warps=nw)
                systems[f"triton {nw} warps"] = (launch, lambda s: (s["outs"]["residual_out"], s["outs"]["norm_out"]))
            for name, (launch, result) in systems.items():
                s0 = sets[0]
                for o in result(s0):
                    o.fill_(float("nan"))
                launch(s0)
                torch.cuda.synchronize()
                r, nrm = result(s0)
                err = (max_ulps(r, ref_r), max_ulps(nrm, ref_n))
                cold = time_graph(launch, sets, calls=len(sets))
                warm = time_graph(launch, sets[:1], calls=10)
                row = dict(hidden=H, top_k=K, tokens=T, system=name, cold_us=cold, warm_us=warm,
                           residual_ulps=err[0], norm_ulps=err[1], valid=err[0] <= 1 and err[1] <= 2)
                rows.append(row)
                print(f"H {H} K {K} T {T:4d} {name:24s} cold {cold:7.2f} warm {warm:7.2f} us"
                      f"  ulps {err[0]:.0f}/{err[1]:.0f}{'' if row['valid'] else '  INVALID'}", flush=True)
            del sets
            torch.cuda.empty_cache()
        ws.close()
    (out / "probe.json").write_text(json.dumps({"gpu": props.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
