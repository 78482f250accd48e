"""Qwen3-MoE's MoE tail on one GPU: transformers' own Qwen3MoeSparseMoeBlock and Qwen3MoeRMSNorm,
mapped onto the op (docs/models-and-engines.md).

    pip install '.[cu13,examples]'        # transformers comes with the examples extra
    python examples/qwen3_moe_tail.py

The layer at Qwen3-30B-A3B's hidden size 2048 and top_k 8 (softmax over the experts, top 8,
renormalized: norm_topk_prob), no shared expert, no routed_scaling_factor, with 16 experts and a
small intermediate size, random weights, nothing downloaded. The model computes
next_norm(residual + moe(x)); the op gets the routed rows and the router's renormalized weights
(bf16, as the router returns them in a bf16 model), at tensor parallelism 1 (LocalWorkspace, with an
NVFP4 copy of norm_out) and 2 (EmulatedWorld: each rank holds half of every expert's intermediate
dimension).

Each case prints ok when the op's residual_out and norm_out lie within one bf16 unit roundoff
(norm-relative) of the exact value of the same rows and within four of the model's own bf16 output,
and the NVFP4 bytes are the rule applied to the op's norm_out (exit 1 otherwise).
"""
import sys

import torch

FAMILY = "qwen3_moe"
T = 64


def close(out, exact, model, u=2.0 ** -8) -> bool:
    """Norm-relative: within u of the exact value, within 4u of the model's bf16 output."""
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    return all(rel(o, e) <= u and rel(o, m) <= 4 * u for o, e, m in zip(out, exact, model))


def main() -> int:
    import dispatch
    from moe_ar_tools import model_tails as mt
    from moe_ar_tools.reference import nvfp4_ref, typical_global_scale

    tail = mt.build_tail(FAMILY, dtype=torch.bfloat16, device="cuda")
    x, residual = mt.tokens(tail, T, seed=0)
    model = mt.model_output(tail, x, residual)
    ok = True
    with dispatch.LocalWorkspace(max_tokens=T, hidden=tail.config.hidden_size, dtype=torch.bfloat16) as ws:
        with torch.no_grad():
            _, weights, experts = tail.router(x)              # renormalized top-8 softmax weights
            rows = mt.expert_rows(tail.experts, x, experts)   # [T, 8, H], each route unweighted
        allreduce_in, idx = mt.permute_by_expert(rows, experts)
        gs = typical_global_scale(model[1])                   # 448 * 6 / amax, from the model's own norm_out
        global_scale = torch.tensor([gs], dtype=torch.float32, device="cuda")
        out = dispatch.moe_finalize_allreduce(ws, allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=idx,
                                              expert_scale_factor=weights, residual_in=residual,
                                              norm_weight=tail.next_norm.weight.detach(),
                                              eps=tail.next_norm.variance_epsilon, quant="nvfp4",
                                              global_scale=global_scale)
        q, s = nvfp4_ref(out.norm_out, gs)
        good = close((out.residual_out, out.norm_out), mt.exact_output(mt.tail_case(tail, x, residual)), model) \
            and torch.equal(out.quant_out, q) and torch.equal(out.scale_out[:s.numel()], s)
        print(f"tensor parallel 1, nvfp4: {'ok' if good else 'MISMATCH'}")
        ok &= good
        ws.check()

    world = dispatch.EmulatedWorld(2, T, tail.config.hidden_size, torch.bfloat16)
    try:
        case = mt.tail_case(tail, x, residual, world_size=2)  # rank r: its half of every expert
        outs = world.run(list(case))
        world.check()
        good = close((outs[0].residual_out, outs[0].norm_out), mt.exact_output(case), model) and \
            torch.equal(outs[1].norm_out, outs[0].norm_out)
        print(f"tensor parallel 2 (emulated on one GPU): {'ok' if good else 'MISMATCH'}")
        ok &= good
    finally:
        world.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
