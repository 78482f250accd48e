"""Hardware counters (Nsight Compute) of the Triton kernel against ours at world size 1: the best
Triton `fused` (num_warps 8), the committed programs (lc, lcs) and the one-token-a-block kernel of
../row_blocks (2 vectors a thread, 448 threads; with and without its epilogue). One set of inputs
a size; ncu flushes the caches before each kernel (cold).

    git apply experiments/world_size_1/split_rows/split_rows.patch && git apply experiments/world_size_1/row_blocks/variants.patch && gen-programs
    ncu --clock-control none --cache-control all -k regex:'^(fused|moe_ar|exp_var)' --set full -o DIR/report python experiments/world_size_1/ncu/probe.py --out DIR
"""
from __future__ import annotations

import importlib.util
import pathlib

import torch

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("row_blocks_variants", HERE.parent / "row_blocks" / "variants.py")
v = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v)
rb, sp = v.rb, v.sp


def main():
    args, out, t_start, l2, mod, state, results = rb.start(300)
    H, K = 7168, 8
    for T in (16384, 1024, 1):
        x = sp.make_sets(T, H, K, True, 1, T)[0]
        o = sp.alloc_outs(T, H, None, 1)[0]
        ws = sp.dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=sp.DT)
        systems = {}
        for fam, family in (("lc", "local"), ("lcs", "local_streaming")):  # labels as in the recorded results
            def call(name=f"moe_ar_{family}_bf16_ws1_plain"):
                sp.dispatch.moe_finalize_allreduce(
                    ws, allreduce_in=x["allreduce_in"], expanded_idx_to_permuted_idx=x["idx"], residual_in=x["residual"],
                    norm_weight=x["gamma"], expert_scale_factor=x["scale"], routed_scaling_factor=sp.RSF,
                    shared_expert_output=x["shared"], eps=sp.EPS, program=name, **o)
            systems[fam] = call
        for var in (0, 4):
            la = rb.Launcher(mod, "plain", 1, 2, 0, H, state.data_ptr(), False, 512, 1, False,
                             name=v.kname("plain", 2, 512, 1, var))
            la.add(T, H, K, x, o, None, None, None)
            systems[f"var_x{var}"] = lambda la=la: la.launch(0)

        def triton():
            sp.tf.fused(o, x["allreduce_in"], x["idx"], x["scale"], x["shared"], x["residual"], x["gamma"], eps=sp.EPS,
                        routed_scaling_factor=sp.RSF, num_warps=8)
        systems["triton_nw8"] = triton
        for name, fn in systems.items():
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            sp.log(f"T {T} {name}: launched twice")
        ws.close()


if __name__ == "__main__":
    main()
