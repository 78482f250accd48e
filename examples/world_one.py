"""World size 1 on one GPU, no torchrun, no process group: the MoE layer tail in one launch.

    python examples/world_one.py

Two cases, each checked against the same computed with torch (prints ok or MISMATCH; exit 1 on a
mismatch):

- tensor parallelism 1: every routed (token, expert) row of FC2, the router weights,
  routed_scaling_factor and the shared expert, then residual add and RMSNorm;
- expert parallelism after the all-to-all combine: the routed rows arrive already weighted and
  summed, one row per token, so the call takes them as top_k 1 with no router weights (plus the
  shared expert, which is not part of the combine), then residual add and RMSNorm.

At world size 1 the partial stays fp32 until the residual add and residual_out is rounded once
(docs/operation.md, "World size 1"); the torch version below does the same in fp32.
"""
import sys

import torch

import dispatch

T, K, E, H, dtype, eps, rsf = 64, 8, 64, 4096, torch.bfloat16, 1e-6, 2.5
g = torch.Generator("cuda").manual_seed(0)
residual = torch.randn(T, H, generator=g, device="cuda").to(dtype)
gamma = torch.randn(H, generator=g, device="cuda").to(dtype)
shared = torch.randn(T, H, generator=g, device="cuda").to(dtype)  # the shared expert's output


def torch_tail(partial):
    """residual_out = D(partial + residual), rounded once; norm_out = D(RMSNorm(residual_out))."""
    residual_out = (partial + residual.float()).to(dtype)
    h = residual_out.float()
    return residual_out, (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * gamma.float()).to(dtype)


def close(a, b):  # norm-relative error within 4 unit roundoffs of bf16
    return float((a.float() - b.float()).norm() / b.float().norm()) < 4 * 2.0 ** -8


ok = True
with dispatch.LocalWorkspace(max_tokens=T * K, hidden=H, dtype=dtype) as ws:  # the current device
    # Tensor parallelism 1: FC2 rows permuted by expert, token t's route k at row idx[t, k].
    experts = torch.rand(T, E, generator=g, device="cuda").topk(K, dim=1).indices  # each token's K experts
    order = experts.flatten().argsort(stable=True)  # rows sorted by expert, as a grouped GEMM writes them
    idx = torch.empty(T * K, dtype=torch.int32, device="cuda")
    idx[order] = torch.arange(T * K, dtype=torch.int32, device="cuda")
    idx = idx.view(T, K)
    weights = torch.rand(T, K, generator=g, device="cuda").softmax(-1)  # router weights, float32
    rows = torch.randn(T * K, H, generator=g, device="cuda").to(dtype)
    out = dispatch.moe_finalize_allreduce(ws, allreduce_in=rows, expanded_idx_to_permuted_idx=idx,
                                          expert_scale_factor=weights, routed_scaling_factor=rsf,
                                          shared_expert_output=shared, residual_in=residual, norm_weight=gamma,
                                          eps=eps)
    partial = (rows[idx.long()].float() * weights.unsqueeze(-1)).sum(1) * rsf + shared.float()
    residual_out, norm_out = torch_tail(partial)
    good = close(out.residual_out, residual_out) and close(out.norm_out, norm_out)
    print(f"tensor parallel 1: {'ok' if good else 'MISMATCH'}")
    ok &= good

    # Expert parallelism: the combine has already weighted and summed each token's routed rows.
    combined = torch.randn(T, H, generator=g, device="cuda").to(dtype)
    one_route = torch.arange(T, dtype=torch.int32, device="cuda").view(T, 1)  # token t -> row t
    out = dispatch.moe_finalize_allreduce(ws, allreduce_in=combined, expanded_idx_to_permuted_idx=one_route,
                                          shared_expert_output=shared, residual_in=residual, norm_weight=gamma,
                                          eps=eps)
    residual_out, norm_out = torch_tail(combined.float() + shared.float())
    good = close(out.residual_out, residual_out) and close(out.norm_out, norm_out)
    print(f"expert parallel, combined rows: {'ok' if good else 'MISMATCH'}")
    ok &= good
    ws.check()  # no route was out of range
sys.exit(0 if ok else 1)
