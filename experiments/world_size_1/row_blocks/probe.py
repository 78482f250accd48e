"""World size 1 on one GPU: one token a block (or a cluster of C blocks), with kVec 16-byte vectors a
thread and a register cap that keeps B blocks resident per multiprocessor (__launch_bounds__(N, B)),
against the committed programs and the Triton baselines, cold and warm L2. The kernel is split_rows'
run_local_split (../split_rows/split_rows.patch); this probe adds the vector counts and the register
caps that test the diagnosis there: bytes in flight per multiprocessor, and a second resident block
whose loads overlap the first one's epilogue.

    git apply experiments/world_size_1/split_rows/split_rows.patch && gen-programs && PYTHONPATH=. python experiments/world_size_1/row_blocks/probe.py --out DIR [--budget-s 400]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("split_probe", HERE.parent / "split_rows" / "probe.py")
sp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sp)

# (vec, max threads, min blocks an SM): the kernels this probe builds, per profile
SHAPES = [(1, 512, 1), (2, 512, 1), (2, 448, 2), (4, 256, 1), (4, 256, 2), (8, 128, 1), (8, 128, 4)]


def kernel_name(profile, vec, load, threads, blocks):
    return f"exp_split_{profile}_v{vec}_l{load}_t{threads}_b{blocks}"


def split_source() -> str:
    ps = sp.registry.program_set()
    from moe_ar_common import manifest_reader as mr
    body = mr.body_source(ps.manifest, ps.dir)
    for prof, cpp in sp.PROFILE_CPP.items():
        for vec, threads, blocks in SHAPES:
            for load in ((0, 2) if prof == "plain" else (0,)):
                name = kernel_name(prof, vec, load, threads, blocks)
                body += (f'extern "C" __global__ void __launch_bounds__({threads}, {blocks}) {name}(const moe_ar::Params p) {{\n'
                         f'  moe_ar::run_local_split<__nv_bfloat16, moe_ar::Profile::{cpp}, {vec}, {load}>(p);\n}}\n')
    # the launch of a kernel that takes the programs' Params and does nothing: what their argument costs
    body += 'extern "C" __global__ void params_only(const moe_ar::Params p) { if (p.tokens < 0) p.state[0] = 1u; }\n'
    return body


sp.split_source = split_source


class Launcher(sp.SplitLauncher):
    """SplitLauncher on the kernel of (vec, threads, blocks)."""

    def __init__(self, mod, profile, C, vec, load, H, state_ptr, pdl=False, threads=512, blocks=1, cluster=True,
                 name=None):
        nvec = H // 8
        slice_vectors = -(-nvec // C // 16) * 16
        if slice_vectors % vec or (slice_vectors // vec) % 16 or slice_vectors // vec > threads:
            raise ValueError("shape")
        self.fn = mod.function(name or kernel_name(profile, vec, load, threads, blocks))
        self.threads = slice_vectors // vec
        self.C, self.vec, self.state_ptr = C, vec, state_ptr
        self.attrs = sp.cluster_attrs(C, pdl)
        if not cluster:  # C = 1 without the cluster attribute (what a plain launch is)
            assert C == 1
            n = int(pdl)
            self.attrs = (sp.L._LaunchAttribute * max(1, n))()
            if pdl:
                self.attrs[0].id = sp.L._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                self.attrs[0].value.programmaticStreamSerializationAllowed = 1
            self._n_attrs = n
        else:
            self._n_attrs = len(self.attrs)
        self.keep, self.params, self.configs = [], [], []
        sp.L._driver()


def start(default_budget_s: float):
    """The run's set-up, shared by this probe and the later ones: options, clocks raised, the floors,
    the split module. Returns (args, out folder, start time, L2 bytes, module, state words, results)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=default_budget_s)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 60 << 20))
    sp.log(f"{props.name} sms {props.multi_processor_count} l2 {l2}")
    sp.warm_clocks()
    fl = sp.floors()
    sp.log(f"floors: {fl}")
    mod = sp.SplitModule()
    state = torch.zeros(8, dtype=torch.int32, device="cuda")
    commit = os.environ.get("MOE_AR_COMMIT") or os.environ.get("COMMIT")
    results = {"gpu": props.name, "l2_bytes": l2, "floors": fl, "points": [], "commit": commit}
    return args, out, t_start, l2, mod, state, results


def main():
    args, out, t_start, l2, mod, state, results = start(420)
    fl = results["floors"]

    # the cost of the programs' argument: a kernel that takes Params and does nothing, in a graph
    x1, o1 = sp.make_sets(1, 7168, 8, True, 1, 0)[0], sp.alloc_outs(1, 7168, None, 1)[0]
    for cluster in (False, True):
        for pdl in (False, True):
            la = Launcher(mod, "plain", 1, 4, 0, 7168, state.data_ptr(), pdl, 256, 1, cluster)
            la.fn = mod.function("params_only")
            la.add(1, 7168, 8, x1, o1, None, None, None)
            results.setdefault("params_only_us", {})[f"cluster{int(cluster)}_pdl{int(pdl)}"] = sp.graph_time_us(
                la.launch, 100)
    sp.log(f"params_only: {results['params_only_us']} (empty kernel {fl['empty_kernel_us']:.2f})")

    # (C, vec, load, threads, blocks, cluster attribute, pdl)
    many = [(1, 4, 0, 256, 1, True, False), (1, 4, 0, 256, 1, False, False), (1, 4, 0, 256, 2, False, False),
            (1, 4, 2, 256, 1, False, False), (1, 8, 0, 128, 1, False, False), (1, 8, 0, 128, 4, False, False),
            (1, 2, 0, 448, 2, False, False), (1, 2, 0, 512, 1, False, False)]
    few = [(2, 4, 0, 256, 1, True, False), (4, 2, 0, 512, 1, True, False), (8, 1, 0, 512, 1, True, False),
           (1, 4, 0, 256, 1, False, True), (8, 1, 0, 512, 1, True, True)]
    plan = []
    all_T = [1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    for mode in ("cold", "warm"):
        for T in all_T:
            plan.append(("plain", T, 7168, 8, True, mode, many + (few if T <= 256 else [])))
    for mode in ("cold",):
        for T in (1, 16, 128, 256, 1024, 4096, 16384):
            plan.append(("fp8_group128", T, 7168, 8, True, mode, many + (few if T <= 256 else [])))
        for (H, K) in ((4096, 2), (2048, 8), (4096, 8)):
            for T in (1, 16, 128, 256, 1024, 8192):
                plan.append(("plain", T, H, K, False, mode, many + (few if T <= 256 else [])))
        for T in (1, 128, 1024, 8192):
            plan.append(("nvfp4", T, 7168, 8, True, mode, many[:3] + (few[:3] if T <= 256 else [])))
    orig = sp.SplitLauncher
    for (prof, T, H, K, sh, mode, variants) in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} H {H} K {K} {mode}")
            results.setdefault("skipped", []).append([prof, T, H, K, sh, mode])
            continue
        # point() builds SplitLauncher(mod, profile, C, vec, load, H, state, pdl=pdl) per variant
        # (C, vec, load, pdl); the shape rides in the load slot as a tuple
        shaped = [(C, vec, f"{load}_t{thr}_b{blk}" + ("" if cl else "_nocl"), pdl)
                  for (C, vec, load, thr, blk, cl, pdl) in variants]

        def make(mod_, profile, C, vec, load, H_, state_ptr, pdl=False):
            ld, thr, blk = load.split("_")[:3]
            return Launcher(mod_, profile, C, vec, int(ld), H_, state_ptr, pdl, int(thr[1:]), int(blk[1:]),
                            not load.endswith("_nocl"))
        sp.SplitLauncher = make
        try:
            r = sp.point(mod, state, prof, T, H, K, sh, mode, l2, shaped, 15 if T <= 2048 else 9, {})
        except Exception as e:  # noqa: BLE001
            sp.log(f"point failed {prof} {T} {H} {K} {mode}: {e}")
            torch.cuda.synchronize()
            continue
        finally:
            sp.SplitLauncher = orig
        results["points"].append(r)
        us = r["us"]
        def best(prefix):
            c = [(v, k) for k, v in us.items() if k.startswith(prefix)]
            return min(c) if c else (float("nan"), "-")
        b_sp, b_old, b_tr, b_ch = best("split"), best("old"), best("triton"), best("chain")
        sp.log(f"{prof:13s} H{H} K{K} T{T:6d} {mode}: split {b_sp[0]:8.2f} ({b_sp[1]}) old {b_old[0]:8.2f} "
               f"triton {b_tr[0]:8.2f} ({b_tr[1]}) chain {b_ch[0]:8.2f} tr/split {b_tr[0] / b_sp[0]:.3f} "
               f"errors {list(r['errors'])} [{time.perf_counter() - t_start:.0f}s]")
        (out / "probe.json").write_text(json.dumps(results, indent=1))
    (out / "probe.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
