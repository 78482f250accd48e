"""Kernels for Nsight Compute's memory counters at 256, 2,048 and 8,192 tokens (H 7168, top_k 8 + shared, bf16,
plain): our streaming program (as the launcher builds it) and the Triton kernel at num_warps 8, each
launched twice on one input set (the inputs of ../mid_tokens/ncu_probe.py).

    ncu --clock-control none --cache-control all -k regex:'^(fused|moe_ar)' --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sector_op_read_hit_rate.pct,smsp__inst_executed.sum \
        python experiments/world_size_1/dram_bytes/ncu_memory.py

Question: does our streaming program move more DRAM bytes, or the same bytes at a lower rate, than
the Triton kernel (bench_results/world_size_1/stream_natural_order/, "Decision")?
"""
from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "mid_tokens"))
import dispatch  # noqa: E402
from moe_ar_tools.baselines import triton_fused as tf  # noqa: E402
from ncu_probe import DT, EPS, H, RSF, inputs  # noqa: E402


def main():
    for T in (256, 2048, 8192):
        x = inputs(T)
        o = {"residual_out": torch.empty(T, H, dtype=DT, device="cuda"),
             "norm_out": torch.empty(T, H, dtype=DT, device="cuda")}
        ws = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=DT)

        def ours():
            dispatch.moe_finalize_allreduce(
                ws, allreduce_in=x["allreduce_in"], expanded_idx_to_permuted_idx=x["idx"], residual_in=x["residual"],
                norm_weight=x["gamma"], expert_scale_factor=x["scale"], routed_scaling_factor=RSF,
                shared_expert_output=x["shared"], eps=EPS, **o)

        def triton():
            tf.fused(o, x["allreduce_in"], x["idx"], x["scale"], x["shared"], x["residual"], x["gamma"], eps=EPS,
                     routed_scaling_factor=RSF, num_warps=8)

        for name, fn in (("ours", ours), ("triton_nw8", triton)):
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            print(f"T {T} {name}: launched twice", flush=True)
        ws.close()


if __name__ == "__main__":
    main()
