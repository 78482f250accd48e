"""World size 1, 32 to 512 tokens (and a many-token check): one token a block with 2 vectors a
thread (448 threads at H 7168, one block a multiprocessor) loaded a few routes at a time
(local_row_batched) instead of all at once (the committed latency program, `old_lc`), the
committed streaming shape (4 vectors a thread, two blocks a multiprocessor), and the streaming shape
on a persistent grid with the next token's route indices loaded during this token's epilogue
(`probe_prefetch`). Against the committed programs and the Triton baselines, every output checked
against the float64 reference first.

    PYTHONPATH=. python experiments/world_size_1/mid_tokens/probe.py --out DIR [--budget-s 300]
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

# (kind, vectors a thread, threads bound, blocks a multiprocessor bound, routes at a time)
SHAPES = [("route", 2, 512, 1, 2), ("route", 2, 512, 1, 4), ("route", 2, 512, 1, 8),
          ("route", 4, 256, 2, 2), ("pref", 4, 256, 2, 2), ("pref", 2, 512, 1, 4), ("pref", 2, 512, 1, 2)]
PROFILES = ("plain", "fp8_group128")


def kname(profile, kind, vec, threads, blocks, batch):
    return f"exp_mid_{profile}_{kind}_v{vec}_t{threads}_b{blocks}_r{batch}"


DEVICE_FN = r'''
namespace moe_ar {
template <typename D, Profile P, int kVec, int kBatch>
__device__ __forceinline__ void probe_by_route(const Params& p) {
  wait_for_previous_kernel();
  allow_next_kernel();
  unsigned bad_rows = 0;
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  for (int t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];
    local_row_batched<D, kVec, kBatch>(p, t, bad_rows, res);
    norm_row<D, P>(p, t, res);
  }
  if (bad_rows) atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows);
}

// the route indices of token t (-1 past top_k or past the last token); top_k <= 8
__device__ __forceinline__ void load_routes(const Params& p, int t, int (&given)[8]) {
  const int* idx = p.expanded_idx + (long long)t * p.top_k;
#pragma unroll
  for (int k = 0; k < 8; ++k) given[k] = t < p.tokens && k < p.top_k ? idx[k] : -1;
}

// local_row_batched with the token's route indices already in registers
template <typename D, int kVec, int kBatch>
__device__ __forceinline__ void row_given_routes(const Params& p, int t, const int (&given)[8], unsigned& bad_rows,
                                                 uint4 (&res)[kMaxVecPerThread]) {
  const int H = p.hidden, K = p.top_k, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  const D* residual = static_cast<const D*>(p.residual_in) + (long long)t * H;
  const D* shared = static_cast<const D*>(p.shared_in) + (long long)t * H;
  uint4 resid[kVec], shared_row[kVec];
  float acc[kVec][8];
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * blockDim.x + threadIdx.x;
    const bool valid = r < vpt && v < nvec;
    resid[r] = valid ? *reinterpret_cast<const uint4*>(residual + v * kElemsPerVec) : make_uint4(0, 0, 0, 0);
    shared_row[r] = valid && p.shared_in != nullptr ? *reinterpret_cast<const uint4*>(shared + v * kElemsPerVec)
                                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  }
#pragma unroll
  for (int k0 = 0; k0 < 8; k0 += kBatch) {
    if (k0 >= K) break;
    int row[kBatch];
    float scale[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int k = k0 + j, g = given[k0 + j];
      const bool in_range = g >= 0 && g < p.rows;
      float s = 0.f;
      if (in_range) {
        if (p.scale_kind == 0) s = 1.f;
        else if (p.scale_kind == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
        else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
      }
      scale[j] = s;
      row[j] = in_range ? g : g >= p.rows ? -2 : -1;
    }
    uint4 rows[kVec][kBatch];
#pragma unroll
    for (int r = 0; r < kVec; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      const bool valid = r < vpt && v < nvec;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        rows[r][j] = valid && row[j] >= 0 ? *reinterpret_cast<const uint4*>(static_cast<const D*>(p.allreduce_in) +
                                                                             (long long)row[j] * H + v * kElemsPerVec)
                                          : make_uint4(0, 0, 0, 0);
        if (valid && row[j] == -2) ++bad_rows;
      }
    }
#pragma unroll
    for (int r = 0; r < kVec; ++r)
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        float x[8];
        Vec<D>::to_float(rows[r][j], x);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(scale[j], x[i], acc[r][i]);
      }
  }
  D* residual_out = static_cast<D*>(p.residual_out) + (long long)t * H;
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    res[r] = make_uint4(0, 0, 0, 0);
    const int v = r * blockDim.x + threadIdx.x;
    if (r >= kVec || r >= vpt || v >= nvec) continue;
    float s[8], x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = acc[r][i] * p.routed_scaling_factor;
    if (p.shared_in != nullptr) {
      Vec<D>::to_float(shared_row[r], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += x[i];
    }
    Vec<D>::to_float(resid[r], x);
    add_residual_from_zero(s, x);
    res[r] = Vec<D>::from_float(s);
    reinterpret_cast<uint4*>(residual_out)[v] = res[r];
  }
}

// persistent grid; the next token's indices are loaded while this token's epilogue runs
template <typename D, Profile P, int kVec, int kBatch>
__device__ __forceinline__ void probe_prefetch(const Params& p) {
  wait_for_previous_kernel();
  allow_next_kernel();
  unsigned bad_rows = 0;
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  int cur[8], nxt[8];
  load_routes(p, blockIdx.x, cur);
  for (int t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];
    row_given_routes<D, kVec, kBatch>(p, t, cur, bad_rows, res);
    load_routes(p, t + gridDim.x, nxt);
    norm_row<D, P>(p, t, res);
#pragma unroll
    for (int k = 0; k < 8; ++k) cur[k] = nxt[k];
  }
  if (bad_rows) atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows);
}
}  // namespace moe_ar
'''


def split_source() -> str:
    ps = sp.registry.program_set()
    from moe_ar_common import manifest_reader as mr
    body = mr.body_source(ps.manifest, ps.dir) + DEVICE_FN
    for prof in PROFILES:
        for kind, vec, threads, blocks, batch in SHAPES:
            fn = "probe_by_route" if kind == "route" else "probe_prefetch"
            body += (f'extern "C" __global__ void __launch_bounds__({threads}, {blocks}) '
                     f'{kname(prof, kind, vec, threads, blocks, batch)}(const moe_ar::Params p) {{\n'
                     f'  moe_ar::{fn}<__nv_bfloat16, moe_ar::Profile::{sp.PROFILE_CPP[prof]}, {vec}, {batch}>(p);\n}}\n')
    return body


sp.split_source = split_source
SMS = None


class PersistentLauncher(rb.Launcher):
    """A grid of min(T, blocks a multiprocessor x multiprocessors): blocks stride over the tokens."""

    def __init__(self, *a, blocks=1, **kw):
        super().__init__(*a, blocks=blocks, **kw)
        self.grid_cap = blocks * SMS

    def add(self, T, *a, **kw):
        super().add(T, *a, **kw)
        self.configs[-1].gridDimX = min(T, self.grid_cap)


def main():
    global SMS
    args, out, t_start, l2, mod, state, results = rb.start(300)
    SMS = torch.cuda.get_device_properties(0).multi_processor_count
    orig = sp.SplitLauncher

    def make(mod_, profile, C, vec, name, H_, state_ptr, pdl=False):
        kind, v, t, b, _ = name.rsplit("_", 5)[-5:]
        cls = PersistentLauncher if kind == "pref" else rb.Launcher
        return cls(mod_, profile, 1, vec, 0, H_, state_ptr, pdl, int(t[1:]), blocks=int(b[1:]), cluster=False,
                   name=name)

    plan = [("plain", T, 7168, 8, True, "cold") for T in (128, 256, 32, 64, 512, 2048, 8192)]
    plan += [("plain", T, 7168, 8, True, "warm") for T in (128, 256)]
    plan += [("fp8_group128", T, 7168, 8, True, "cold") for T in (128, 256)]
    plan += [("plain", T, 4096, 8, False, "cold") for T in (128, 1024)]
    for prof, T, H, K, sh, mode in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} H {H} {mode}")
            continue
        variants = [(1, vec, kname(prof, kind, vec, thr, blk, bt), False) for kind, vec, thr, blk, bt in SHAPES]
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
        tr = min((v, k) for k, v in us.items() if k.startswith("triton")) if any(
            k.startswith("triton") for k in us) else (float("nan"), "-")
        old = " ".join(f"{k}={v:.2f}" for k, v in sorted(us.items()) if k.startswith("old"))
        sp.log(f"{prof} H{H} K{K} T{T} {mode}: triton {tr[0]:.2f} ({tr[1]}) {old} | " + " ".join(
            f"{k.replace('split_c1_', '').replace('_l' + 'exp_mid_' + prof, '')}={v:.2f}"
            for k, v in sorted(us.items()) if k.startswith("split")) + f" errors {sorted(r['errors'])}")
        (out / "probe.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
