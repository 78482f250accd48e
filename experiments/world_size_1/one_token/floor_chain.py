"""Experiment: the 1-token chain by piece (floor_chain.cu), inputs in separate allocations or one packed allocation a set; graph replay of back-to-back calls. Run with PYTHONPATH=. and $OUT."""
import json, os, sys
import torch, cupy as cp
import dispatch
from moe_ar_common import cuda_env
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import timed, warm_up  # noqa: E402
out = os.environ["OUT"]
H, K = 7168, 8
dev = torch.device("cuda")
mod = cp.RawModule(code=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor_chain.cu")).read(),
                   options=("-std=c++17", "--gpu-architecture=sm_90a", "-I" + cuda_env.include_dir()))
warm_up()

def sets(n, packed, seed=0):
    g = torch.Generator(device=dev); g.manual_seed(seed)
    S = []
    for i in range(n):
        rows = (0.5 * torch.randn(K, H, generator=g, device=dev)).to(torch.bfloat16)
        idx = torch.randperm(K, generator=g, device=dev).to(torch.int32)
        sc = torch.rand(K, generator=g, device=dev) + 0.05; sc /= sc.sum()
        sh = (0.5 * torch.randn(1, H, generator=g, device=dev)).to(torch.bfloat16)
        rs = torch.randn(1, H, generator=g, device=dev).to(torch.bfloat16)
        gm = (1 + 0.1 * torch.randn(H, generator=g, device=dev)).to(torch.bfloat16)
        parts = [rows, idx, sc, sh, rs, gm, torch.empty(1, H, device=dev, dtype=torch.bfloat16),
                 torch.empty(1, H, device=dev, dtype=torch.bfloat16)]
        if packed:  # one allocation: each part at a 256-byte aligned offset
            sizes = [(p.numel() * p.element_size() + 255) // 256 * 256 for p in parts]
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
            off, new = 0, []
            for p, s in zip(parts, sizes):
                v = buf[off:off + p.numel() * p.element_size()].view(p.dtype).view(p.shape); v.copy_(p); new.append(v); off += s
            parts = new
        S.append(parts)
    return S


empty = mod.get_function("empty_kernel")
res = {}
for label, n_sets in (("l2", 10), ("hbm", 400)):
    for packed in (False, True):
        S = sets(n_sets, packed)
        r = {"empty": timed(lambda i: empty((1,), (32,), ()), n_sets, n_sets)}
        for name, C, thr in (("tail_c1_v2_n1_", 1, 448), ("tail_c1_v2_n0_", 1, 448), ("tail_c8_v1_n1_", 8, 112),
                             ("tail_c8_v1_n0_", 8, 112), ("tail_c4_v1_n1_", 4, 224)):
            f = mod.get_function(name)
            def launch(i, f=f, C=C, thr=thr):
                f((C,), (thr,), tuple(cp.uint64(x.data_ptr()) for x in S[i]) + (cp.int32(H),))
            r[name] = timed(launch, n_sets, n_sets)
        ws = dispatch.LocalWorkspace(max_tokens=16, hidden=H, dtype=torch.bfloat16)
        for pdl in (False, True):
            def ours(i, pdl=pdl):
                rows, idx, sc, sh, rs, gm, ro, no = S[i]
                dispatch.moe_finalize_allreduce(ws, allreduce_in=rows, expanded_idx_to_permuted_idx=idx.view(1, K),
                    residual_in=rs, norm_weight=gm, expert_scale_factor=sc.view(1, K), routed_scaling_factor=2.5,
                    shared_expert_output=sh, eps=1e-6, residual_out=ro, norm_out=no, launch_with_pdl=pdl)
            r["ours_pdl" if pdl else "ours"] = timed(ours, n_sets, n_sets)
        res[f"{label}_{'packed' if packed else 'separate'}"] = r
        print(label, packed, json.dumps(r), flush=True)
        del S; torch.cuda.empty_cache()
json.dump(res, open(f"{out}/floor_chain.json", "w"), indent=1)
