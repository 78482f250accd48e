"""World size 1: one token a block, loaded route by route (kernels/local.cuh local_row_batched) under
a register bound that keeps two (or three) blocks a multiprocessor, so one block's epilogue runs
under another's loads: what Nsight Compute showed the Triton kernel does (../ncu/). Against the
committed programs and the Triton baselines, cold and warm L2, every output checked first.

    PYTHONPATH=. python experiments/world_size_1/two_blocks/probe.py --out DIR [--budget-s 400]
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

# (vectors a thread, threads bound, blocks a multiprocessor bound)
SHAPES = [(4, 256, 2, 4), (4, 256, 2, 2), (4, 256, 2, 8), (2, 512, 2, 4), (2, 512, 1, 8), (2, 512, 2, 8)]
PROFILES = ("plain", "fp8_group128", "nvfp4")


def kname(profile, vec, threads, blocks, batch):
    return f"exp_pair_{profile}_v{vec}_t{threads}_b{blocks}_r{batch}"


DEVICE_FN = r'''
namespace moe_ar {
template <typename D, Profile P, int kVec, int kBatch>
__device__ __forceinline__ void probe_by_route(const Params& p) {
  wait_for_previous_kernel();
  allow_next_kernel();
  unsigned bad_rows = 0;
  if (P == Profile::kNvfp4) fill_nvfp4_reciprocals(p);
  if (P == Profile::kNvfp4) zero_scale_padding(p);
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  for (int t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];
    local_row_batched<D, kVec, kBatch>(p, t, bad_rows, res);
    norm_row<D, P>(p, t, res);
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
        for vec, threads, blocks, batch in SHAPES:
            body += (f'extern "C" __global__ void __launch_bounds__({threads}, {blocks}) '
                     f'{kname(prof, vec, threads, blocks, batch)}(const moe_ar::Params p) {{\n'
                     f'  moe_ar::probe_by_route<__nv_bfloat16, moe_ar::Profile::{sp.PROFILE_CPP[prof]}, {vec}, {batch}>(p);\n}}\n')
    return body


sp.split_source = split_source


def main():
    args, out, t_start, l2, mod, state, results = rb.start(420)
    orig = sp.SplitLauncher

    def make(mod_, profile, C, vec, name, H_, state_ptr, pdl=False):
        v, t, b, _ = name.rsplit("_", 4)[-4:]
        return rb.Launcher(mod_, profile, 1, vec, 0, H_, state_ptr, pdl, int(t[1:]), int(b[1:]), False,
                           name=name)

    plan = []
    for T in (16384, 4096, 1024, 256, 64, 16, 1):
        plan.append(("plain", T, 7168, 8, True, "cold"))
    for T in (16384, 1024, 64, 1):
        plan.append(("fp8_group128", T, 7168, 8, True, "cold"))
    for T in (4096, 256, 16):
        plan.append(("plain", T, 7168, 8, True, "warm"))
    for (H, K) in ((4096, 2), (2048, 8), (4096, 8)):
        for T in (8192, 1024, 128, 1):
            plan.append(("plain", T, H, K, False, "cold"))
    for T in (8192, 1024, 1):
        plan.append(("nvfp4", T, 7168, 8, True, "cold"))
    for prof, T, H, K, sh, mode in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} H {H} {mode}")
            continue
        variants = [(1, vec, kname(prof, vec, thr, blk, bt), False) for vec, thr, blk, bt in SHAPES]
        if T <= 64:
            variants.append((1, 4, kname(prof, 4, 256, 2, 8), True))
        sp.SplitLauncher = make
        try:
            r = sp.point(mod, state, prof, T, H, K, sh, mode, l2, variants, 15 if T <= 2048 else 9, {},
                         pdl_variants=T <= 64)
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
        old = min(v for k, v in us.items() if k.startswith("old"))
        sp.log(f"{prof} H{H} K{K} T{T} {mode}: triton {tr[0]:.2f} ({tr[1]}) old {old:.2f} | " + " ".join(
            f"{k.replace('split_c1_', '').replace('_l' + 'exp_pair_' + prof, '')}={v:.2f}"
            for k, v in sorted(us.items()) if k.startswith("split")) + f" errors {sorted(r['errors'])}")
        (out / "probe.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
