"""Kernels for ncu: lc / lcs at H 4096 and 7168 (T 8192), lcs FP8-group at 2048, lc at 1 token."""
import torch, dispatch
dev = torch.device("cuda")
g = torch.Generator(device=dev); g.manual_seed(0)
def call(H, shared, T, prog, quant=None):
    K = 8
    ws = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=torch.bfloat16)
    rows = (0.5 * torch.randn(T * K, H, generator=g, device=dev)).to(torch.bfloat16)
    idx = torch.randperm(T * K, generator=g, device=dev).to(torch.int32).view(T, K)
    sc = torch.rand(T, K, generator=g, device=dev)
    sh = (0.5 * torch.randn(T, H, generator=g, device=dev)).to(torch.bfloat16) if shared else None
    rs = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    gm = torch.ones(H, device=dev, dtype=torch.bfloat16)
    kw = dict(quant=quant) if quant else {}
    if quant == "fp8_group128": pass
    for _ in range(2):
        dispatch.moe_finalize_allreduce(ws, allreduce_in=rows, expanded_idx_to_permuted_idx=idx, residual_in=rs,
            norm_weight=gm, expert_scale_factor=sc, routed_scaling_factor=2.5, shared_expert_output=sh,
            program=prog, **kw)
    torch.cuda.synchronize()
call(4096, False, 8192, "moe_ar_local_bf16_ws1_plain")
call(4096, False, 8192, "moe_ar_local_streaming_bf16_ws1_plain")
call(7168, True, 8192, "moe_ar_local_bf16_ws1_plain")
call(7168, True, 8192, "moe_ar_local_streaming_bf16_ws1_plain")
call(7168, True, 2048, "moe_ar_local_streaming_bf16_ws1_fp8_group128", "fp8_group128")
call(7168, True, 1, "moe_ar_local_bf16_ws1_plain")
