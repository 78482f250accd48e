"""World size 1, few tokens: the latency program (lc) with its cluster layout (a token over a
cluster of blocks, kernels/local.cuh) against the same program without it (the manifest's
cluster_max_tokens set to 0 in this process) and the Triton baselines, with and without PDL, cold
and warm L2. Every output is checked against the float64 reference, and the two layouts' outputs
are compared bit for bit.

    PYTHONPATH=. python experiments/world_size_1/cluster/probe.py --out DIR [--budget-s 200]
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
sp.split_source = lambda: 'extern "C" __global__ void unused_kernel() {}\n'


def outputs_of(ws, x, o, quant, gs, fp8s):
    extra = {"global_scale": gs} if quant == "nvfp4" else {"fp8_scale": fp8s} if quant == "fp8_tensor" else {}
    for v in o.values():
        v.view(torch.uint8).fill_(0xFF)
    sp.dispatch.moe_finalize_allreduce(
        ws, allreduce_in=x["allreduce_in"], expanded_idx_to_permuted_idx=x["idx"], residual_in=x["residual"],
        norm_weight=x["gamma"], expert_scale_factor=x["scale"], routed_scaling_factor=sp.RSF,
        shared_expert_output=x["shared"], eps=sp.EPS, quant=quant, program=ws.lc_name, **extra, **o)
    torch.cuda.synchronize()
    return {k: v.clone() for k, v in o.items()}


def main():
    args, out, t_start, l2, mod, state, results = rb.start(200)
    limits = sp.registry.program_set().limits
    cluster_max = limits["cluster_max_tokens"]
    results["bits"] = []
    # bit identity of the two layouts, every profile, a few shapes
    for prof in ("plain", "nvfp4", "fp8_group128", "fp8_tensor"):
        for (H, K, sh) in ((7168, 8, True), (4096, 2, False), (2048, 8, False), (5120, 6, True)):
            T = 5
            quant = sp.PROFILE_QUANT[prof]
            x = sp.make_sets(T, H, K, sh, 1, H + K)[0]
            o = sp.alloc_outs(T, H, quant, 1)[0]
            gs = torch.tensor([0.7], device="cuda")
            fp8s = torch.tensor([0.01], device="cuda")
            got = []
            for cmax in (cluster_max, 0):
                limits["cluster_max_tokens"] = cmax
                ws = sp.dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=sp.DT)
                ws.lc_name = f"moe_ar_local_bf16_ws1_{prof}"
                got.append(outputs_of(ws, x, o, quant, gs, fp8s))
                ws.close()
            limits["cluster_max_tokens"] = cluster_max
            diff = {k: int((got[0][k].view(torch.uint8) != got[1][k].view(torch.uint8)).sum()) for k in got[0]}
            results["bits"].append({"profile": prof, "hidden": H, "top_k": K, "tokens": T, "bytes_differing": diff})
            sp.log(f"bits {prof} H{H} K{K} T{T}: bytes differing {diff}")
    plan = [(prof, T, 7168, 8, True, mode) for mode in ("cold", "warm") for prof in ("plain", "fp8_group128")
            for T in (1, 4, 16, 32)]
    plan += [(prof, T, 7168, 8, True, "cold") for prof in ("nvfp4", "fp8_tensor") for T in (1, 16)]
    plan += [("plain", T, H, K, False, "cold") for (H, K) in ((4096, 2), (2048, 8), (4096, 8)) for T in (1, 16)]
    for prof, T, H, K, sh, mode in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} H {H} {mode}")
            continue
        r = {}
        for tag, cmax in (("cluster", max(cluster_max, 32)), ("one_block", 0)):
            limits["cluster_max_tokens"] = cmax
            try:
                r[tag] = sp.point(mod, state, prof, T, H, K, sh, mode, l2, [], 15, {}, pdl_variants=True)
            finally:
                limits["cluster_max_tokens"] = cluster_max
        us_c, us_b = r["cluster"]["us"], r["one_block"]["us"]
        tr = min((v, k) for k, v in us_c.items() if k.startswith("triton")) if any(
            k.startswith("triton") for k in us_c) else (float("nan"), "-")
        row = {"profile": prof, "tokens": T, "hidden": H, "top_k": K, "shared": sh, "mode": mode,
               "triton": tr[0], "triton_variant": tr[1],
               "cluster": us_c["old_lc"], "cluster_pdl": us_c["old_lc_pdl"],
               "one_block": us_b["old_lc"], "one_block_pdl": us_b["old_lc_pdl"],
               "errors": sorted(r["cluster"]["errors"]) + sorted(r["one_block"]["errors"])}
        results["points"].append(row)
        sp.log(f"{prof} H{H} K{K} T{T} {mode}: triton {tr[0]:.2f} | cluster {row['cluster']:.2f} pdl "
               f"{row['cluster_pdl']:.2f} | one block {row['one_block']:.2f} pdl {row['one_block_pdl']:.2f} | "
               f"triton/cluster {tr[0] / row['cluster']:.3f} pdl {tr[0] / row['cluster_pdl']:.3f} errors {row['errors']}")
        (out / "probe.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
