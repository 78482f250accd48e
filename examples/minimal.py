"""The smallest two-GPU use: one fused MoE finalize + all-reduce + residual add + RMSNorm.

    torchrun --nproc-per-node 2 examples/minimal.py

Each rank holds its own expert output rows; the routing, the residual and the norm weight are the
same on every rank (tensor parallelism replicates them). The call's outputs are checked against
the same computed with torch; each rank prints ok or MISMATCH (exit 1).
"""
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (needed on shared hosts)
import torch
import torch.distributed as dist

import dispatch

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
T, K, H, dtype, eps = 16, 8, 4096, torch.bfloat16, 1e-6
ws = dispatch.Workspace(dist.group.WORLD, max_tokens=T, hidden=H, dtype=dtype)  # collective

same = torch.Generator("cuda").manual_seed(0)  # the same values on every rank
idx = torch.randperm(T * K, generator=same, device="cuda").view(T, K).to(torch.int32)  # token t, route k -> row
weights = torch.rand(T, K, generator=same, device="cuda")  # router weights, float32
residual = torch.randn(T, H, generator=same, device="cuda").to(dtype)
gamma = torch.randn(H, generator=same, device="cuda").to(dtype)
mine = torch.Generator("cuda").manual_seed(1 + rank)  # this rank's own expert outputs
rows = torch.randn(T * K, H, generator=mine, device="cuda").to(dtype)

out = dispatch.moe_finalize_allreduce(ws, allreduce_in=rows, expanded_idx_to_permuted_idx=idx,
                                      expert_scale_factor=weights, residual_in=residual, norm_weight=gamma, eps=eps)

# torch: each rank's weighted sum of a token's rows (rounded once), the ranks' sum plus the residual, RMSNorm
partial = (rows[idx.long()].float() * weights.unsqueeze(-1)).sum(1).to(dtype)
partials = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
dist.all_gather(partials, partial)
residual_out = (sum(p.float() for p in partials) + residual.float()).to(dtype)
h = residual_out.float()
norm_out = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * gamma.float()).to(dtype)


def close(a, b):  # norm-relative error within 4 unit roundoffs of bf16
    return float((a.float() - b.float()).norm() / b.float().norm()) < 4 * 2.0 ** -8


ok = close(out.residual_out, residual_out) and close(out.norm_out, norm_out)
print(f"rank {rank}: {'ok' if ok else 'MISMATCH'}")
ws.close()  # collective
dist.destroy_process_group()
sys.exit(0 if ok else 1)
