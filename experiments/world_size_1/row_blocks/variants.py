"""The second row_blocks run: where the time of the one-token-a-block kernel goes at many tokens.
Variants of run_local_split (variants.patch, on top of ../split_rows/split_rows.patch): bit 1 loads
route by route (route-major, the Triton kernel's order) instead of vector by vector; bit 2 the
weights read with the indices instead of after them; bit 4 no epilogue (timing only: norm_out is
not written, so its check fails by design).

    git apply experiments/world_size_1/split_rows/split_rows.patch && git apply experiments/world_size_1/row_blocks/variants.patch && gen-programs && PYTHONPATH=. python experiments/world_size_1/row_blocks/variants.py --out DIR
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("row_blocks_probe", HERE / "probe.py")
rb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rb)
sp = rb.sp

# (profile, vec, threads, blocks, variant)
KERNELS = [("plain", v, t, b, var) for (v, t, b) in ((2, 512, 1), (4, 256, 1), (1, 512, 1)) for var in (0, 1, 2, 3, 4)]
KERNELS += [("fp8_group128", v, t, 1, var) for (v, t) in ((2, 512), (1, 512)) for var in (0, 3)]


def kname(profile, vec, threads, blocks, variant):
    return f"exp_var_{profile}_v{vec}_t{threads}_b{blocks}_x{variant}"


def split_source() -> str:
    ps = sp.registry.program_set()
    from moe_ar_common import manifest_reader as mr
    body = mr.body_source(ps.manifest, ps.dir)
    for prof, vec, threads, blocks, var in KERNELS:
        body += (f'extern "C" __global__ void __launch_bounds__({threads}, {blocks}) '
                 f'{kname(prof, vec, threads, blocks, var)}(const moe_ar::Params p) {{\n'
                 f'  moe_ar::run_local_split<__nv_bfloat16, moe_ar::Profile::{sp.PROFILE_CPP[prof]}, {vec}, 0, {var}>(p);\n}}\n')
    return body


sp.split_source = split_source


def run_plan(ctx, plan, json_name: str) -> None:
    """Each point of `plan` ((profile, T, L2 mode, [(C, kernel)])) against the committed programs and
    Triton, logged and written to json_name as it goes."""
    args, out, t_start, l2, mod, state, results = ctx
    orig = sp.SplitLauncher

    def make(mod_, profile, C, vec, name, H_, state_ptr, pdl=False):
        return rb.Launcher(mod_, "plain", C, vec, 0, H_, state_ptr, pdl, 512, 1, C > 1, name=name)
    for prof, T, mode, variants in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} {mode}")
            continue
        shaped = [(C, k[1], kname(*k), False) for C, k in variants]
        sp.SplitLauncher = make
        try:
            r = sp.point(mod, state, prof, T, 7168, 8, True, mode, l2, shaped, 15 if T <= 2048 else 9, {})
        except Exception as e:  # noqa: BLE001
            sp.log(f"point failed {prof} {T} {mode}: {e}")
            torch.cuda.synchronize()
            continue
        finally:
            sp.SplitLauncher = orig
        results["points"].append(r)
        us = r["us"]
        tr = min((v, k) for k, v in us.items() if k.startswith("triton"))
        old = min(v for k, v in us.items() if k.startswith("old"))
        sp.log(f"{prof} T{T} {mode}: triton {tr[0]:.2f} ({tr[1]}) old {old:.2f} | " + " ".join(
            f"{k.replace('split_', '').replace('exp_var_', '').replace(prof + '_', '')}={v:.2f}"
            for k, v in sorted(us.items()) if k.startswith("split")) + f" errors {sorted(r['errors'])}")
        (out / json_name).write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


def main():
    ctx = rb.start(420)
    plan = []
    for T in (1, 16, 64, 256, 1024, 4096, 16384):
        for prof in ("plain", "fp8_group128"):
            if prof == "fp8_group128" and T not in (1, 16, 64, 1024, 16384):
                continue
            ks = [k for k in KERNELS if k[0] == prof]
            # (C, kernel): one token a block for every kernel, a cluster of 8 for the 1-vector ones
            variants = [(1, k) for k in ks if k[1] > 1] + [(8, k) for k in ks if k[1] == 1 and T <= 64]
            plan.append((prof, T, "cold", variants))
    plan += [("plain", T, "warm", [(1, k) for k in KERNELS if k[0] == "plain" and k[1] > 1])
             for T in (256, 4096)]
    run_plan(ctx, plan, "variants.json")


if __name__ == "__main__":
    main()
