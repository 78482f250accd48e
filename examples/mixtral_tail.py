"""Mixtral's MoE tail on one GPU: transformers' own MixtralSparseMoeBlock and MixtralRMSNorm, mapped
onto the op (docs/models-and-engines.md).

    pip install '.[cu13,examples]'        # transformers comes with the examples extra
    python examples/mixtral_tail.py

The layer at Mixtral-8x7B's hidden size 4096, 8 experts and top_k 2 (softmax, top 2, always
renormalized; float32 weights), no shared expert, no routed_scaling_factor, RMSNorm eps 1e-5, with a
small intermediate size, random weights, nothing downloaded. The model computes
next_norm(residual + moe(x)); the op gets the routed rows and the router's weights at tensor
parallelism 1 (LocalWorkspace, with an FP8 per-tensor copy of norm_out), 8 (EmulatedWorld: each rank
holds an eighth of every expert's intermediate dimension), and after an all-to-all combine (expert
parallelism: one summed row per token, top_k 1, no weights).

Each case prints ok when the op's residual_out and norm_out lie within one bf16 unit roundoff
(norm-relative) of the exact value of the same rows and within four of the model's own bf16 output,
and the FP8 bytes are the rule applied to the op's norm_out (exit 1 otherwise).
"""
import sys

import torch

FAMILY = "mixtral"
T = 64


def close(out, exact, model, u=2.0 ** -8) -> bool:
    """Norm-relative: within u of the exact value, within 4u of the model's bf16 output."""
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    return all(rel(o, e) <= u and rel(o, m) <= 4 * u for o, e, m in zip(out, exact, model))


def main() -> int:
    import dispatch
    from moe_ar_tools import model_tails as mt
    from moe_ar_tools.reference import fp8_tensor_ref

    tail = mt.build_tail(FAMILY, num_experts=8, dtype=torch.bfloat16, device="cuda")
    x, residual = mt.tokens(tail, T, seed=0)
    model = mt.model_output(tail, x, residual)
    norm = dict(norm_weight=tail.next_norm.weight.detach(), eps=tail.next_norm.variance_epsilon)
    ok = True
    with dispatch.LocalWorkspace(max_tokens=T, hidden=tail.config.hidden_size, dtype=torch.bfloat16) as ws:
        with torch.no_grad():
            _, weights, experts = tail.router(x)              # renormalized top-2 softmax weights, float32
            rows = mt.expert_rows(tail.experts, x, experts)   # [T, 2, H], each route unweighted
        allreduce_in, idx = mt.permute_by_expert(rows, experts)
        scale = float(model[1].abs().max()) / 448             # a per-tensor scale from the model's own norm_out
        out = dispatch.moe_finalize_allreduce(ws, allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=idx,
                                              expert_scale_factor=weights, residual_in=residual, **norm,
                                              quant="fp8_tensor", fp8_scale=torch.tensor([scale], device="cuda"))
        fp8 = fp8_tensor_ref(out.norm_out, scale)
        good = close((out.residual_out, out.norm_out), mt.exact_output(mt.tail_case(tail, x, residual)), model) \
            and torch.equal(out.quant_out.view(torch.uint8), fp8.view(torch.uint8))
        print(f"tensor parallel 1, fp8_tensor: {'ok' if good else 'MISMATCH'}")
        ok &= good

        case = mt.combined_case(tail, x, residual)          # the combine's weighted sum, one row per token
        out = dispatch.moe_finalize_allreduce(ws, **case[0])
        good = close((out.residual_out, out.norm_out), mt.exact_output(case), model)
        print(f"expert parallel, combined rows: {'ok' if good else 'MISMATCH'}")
        ok &= good
        ws.check()

    world = dispatch.EmulatedWorld(8, T, tail.config.hidden_size, torch.bfloat16)
    try:
        case = mt.tail_case(tail, x, residual, world_size=8)  # rank r: its eighth of every expert
        outs = world.run(list(case))
        world.check()
        good = close((outs[0].residual_out, outs[0].norm_out), mt.exact_output(case), model) and all(
            torch.equal(o.norm_out, outs[0].norm_out) for o in outs)
        print(f"tensor parallel 8 (emulated on one GPU): {'ok' if good else 'MISMATCH'}")
        ok &= good
    finally:
        world.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
