"""World size 1, many tokens, plain: the streaming program's shape (4 vectors a thread, two blocks a
multiprocessor, 2 routes at a time) with 224 threads (the row exactly) or 256 (the Triton kernel's
8 warps, the last vector of half of them empty), with the committed block sum (three barriers a
row) or one barrier a row (the warp sums double-buffered by token parity, every warp adding them
itself: the same bits). Against the committed programs and the Triton baselines, outputs checked.

    PYTHONPATH=. python experiments/world_size_1/mid_tokens/streaming_probe.py --out DIR
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("row_blocks_probe", HERE.parent / "row_blocks" / "probe.py")
rb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rb)
sp = rb.sp

# (barriers a row, launched threads, routes at a time)
SHAPES = [(3, 224, 2), (1, 224, 2), (3, 256, 2), (1, 256, 2)]


def kname(bars, threads, batch):
    return f"exp_str_plain_k{bars}_t{threads}_r{batch}"


DEVICE_FN = r'''
namespace moe_ar {
// block_sum with one barrier a row: warp sums in buffer `parity` (the token count of this block mod 2);
// every warp adds them itself in warp 0's order, so the same bits.
__device__ __forceinline__ float block_sum_one_barrier(float x, int parity) {
  __shared__ float warp_sums[2][kMaxThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[parity][warp] = x;
  __syncthreads();
  float y = lane < (int)(blockDim.x / 32) ? warp_sums[parity][lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
  return y;
}

template <typename D, bool kOneBarrier>
__device__ __forceinline__ void norm_row_plain(const Params& p, int t, const uint4 (&res)[kMaxVecPerThread], int parity) {
  const int H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  uint4 gamma[kMaxVecPerThread];
  float sumsq = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * blockDim.x + threadIdx.x;
    gamma[r] = make_uint4(0, 0, 0, 0);
    if (r < vpt && v < nvec) {
      gamma[r] = load_readonly(static_cast<const D*>(p.norm_weight) + v * kElemsPerVec);
      float x[8];
      Vec<D>::to_float(res[r], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) sumsq = fmaf(x[i], x[i], sumsq);
    }
  }
  const float total = kOneBarrier ? block_sum_one_barrier(sumsq, parity) : block_sum(sumsq);
  const float rms = rsqrtf(__fdiv_rn(total, (float)H) + p.eps);
  D* norm_out = static_cast<D*>(p.norm_out) + (long long)t * H;
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * blockDim.x + threadIdx.x;
    if (r >= vpt || v >= nvec) continue;
    float g[8], x[8], y[8];
    Vec<D>::to_float(gamma[r], g);
    Vec<D>::to_float(res[r], x);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(__fmul_rn(x[i], rms), g[i] + p.weight_bias);
    reinterpret_cast<uint4*>(norm_out)[v] = Vec<D>::from_float(y);
  }
}

template <typename D, bool kOneBarrier, int kBatch>
__device__ __forceinline__ void probe_streaming(const Params& p) {
  wait_for_previous_kernel();
  allow_next_kernel();
  unsigned bad_rows = 0;
  int parity = 0;
  for (int t = blockIdx.x; t < p.tokens; t += gridDim.x, parity ^= 1) {
    uint4 res[kMaxVecPerThread];
    local_row_batched<D, 4, kBatch>(p, t, bad_rows, res);
    norm_row_plain<D, kOneBarrier>(p, t, res, parity);
  }
  if (bad_rows) atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows);
}
}  // namespace moe_ar
'''


def split_source() -> str:
    ps = sp.registry.program_set()
    from moe_ar_common import manifest_reader as mr
    body = mr.body_source(ps.manifest, ps.dir) + DEVICE_FN
    for bars, threads, batch in SHAPES:
        body += (f'extern "C" __global__ void __launch_bounds__(256, 2) '
                 f'{kname(bars, threads, batch)}(const moe_ar::Params p) {{\n'
                 f'  moe_ar::probe_streaming<__nv_bfloat16, {"true" if bars == 1 else "false"}, {batch}>(p);\n}}\n')
    return body


sp.split_source = split_source
SMS = None


class StreamingLauncher(rb.Launcher):
    """threads launched as named; a persistent grid of two blocks a multiprocessor."""

    def __init__(self, *a, threads_launched=224, **kw):
        super().__init__(*a, **kw)
        self.threads = threads_launched

    def add(self, T, *a, **kw):
        super().add(T, *a, **kw)
        self.configs[-1].gridDimX = min(T, 2 * SMS)
        self.configs[-1].blockDimX = self.threads


def main():
    global SMS
    args, out, t_start, l2, mod, state, results = rb.start(200)
    SMS = torch.cuda.get_device_properties(0).multi_processor_count
    orig = sp.SplitLauncher

    def make(mod_, profile, C, vec, name, H_, state_ptr, pdl=False):
        threads = int(name.rsplit("_", 2)[-2][1:])
        return StreamingLauncher(mod_, profile, 1, vec, 0, H_, state_ptr, pdl, 256, 2, False, name=name,
                                 threads_launched=threads)

    plan = [("plain", T, 7168, 8, True, "cold") for T in (2048, 8192, 1024, 256, 16384)]
    plan += [("plain", T, 7168, 8, True, "warm") for T in (256, 1024)]
    for prof, T, H, K, sh, mode in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} H {H} {mode}")
            continue
        variants = [(1, 4, kname(b, t, r), False) for b, t, r in SHAPES]
        sp.SplitLauncher = make
        try:
            r = sp.point(mod, state, prof, T, H, K, sh, mode, l2, variants, 15 if T <= 2048 else 9, {})
        except Exception as e:  # noqa: BLE001
            sp.log(f"point failed {prof} {T} {H} {mode}: {e}")
            torch.cuda.synchronize()
            continue
        finally:
            sp.SplitLauncher = orig
        results["points"].append(r)
        us = r["us"]
        tr = min((v, k) for k, v in us.items() if k.startswith("triton"))
        old = " ".join(f"{k}={v:.2f}" for k, v in sorted(us.items()) if k.startswith("old"))
        sp.log(f"{prof} H{H} K{K} T{T} {mode}: triton {tr[0]:.2f} ({tr[1]}) {old} | " + " ".join(
            f"{k.replace('split_c1_v4_lexp_str_plain_', '')}={v:.2f}" for k, v in sorted(us.items())
            if k.startswith("split")) + f" errors {sorted(r['errors'])} bits {r['bits_vs_split']}")
        (out / "streaming_probe.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
