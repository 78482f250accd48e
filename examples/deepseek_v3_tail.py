"""DeepSeek-V3's MoE tail on one GPU: transformers' own DeepseekV3MoE and DeepseekV3RMSNorm, mapped
onto the op (docs/models-and-engines.md).

    pip install '.[cu13,examples]'        # transformers comes with the examples extra
    python examples/deepseek_v3_tail.py

The layer at its real hidden size 7168 and top_k 8 (sigmoid scores, 8 groups of which 4 are kept,
renormalized, routed_scaling_factor 2.5 folded into the weights by the router) with 16 routed experts,
one shared expert and a small intermediate size, random weights, nothing downloaded. The model
computes next_norm(residual + moe(x)); the op gets what an engine holds at that point:

- tensor parallelism 1 (LocalWorkspace): every route's expert row, permuted by expert, the router's
  weights with routed_scaling_factor 1.0 (the router folded 2.5 in), the shared expert's row; and the
  same with the op applying 2.5 to the router's unscaled weights; quantized to FP8 with per-128
  scales, as DeepSeek-V3's block-FP8 GEMMs read their activations;
- tensor parallelism 4 on one GPU (EmulatedWorld): each rank's experts and shared expert hold a
  quarter of the intermediate dimension, so each rank's rows are partial sums.

Each case prints ok when the op's residual_out and norm_out lie within one bf16 unit roundoff
(norm-relative) of the exact value of the same rows and within four of the model's own bf16 output,
and the FP8 bytes are the rule applied to the op's norm_out (exit 1 otherwise).
"""
import sys

import torch

FAMILY = "deepseek_v3"
T = 64


def close(out, exact, model, u=2.0 ** -8) -> bool:
    """Norm-relative: within u of the exact value, within 4u of the model's bf16 output."""
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    return all(rel(o, e) <= u and rel(o, m) <= 4 * u for o, e, m in zip(out, exact, model))


def main() -> int:
    import dispatch
    from moe_ar_tools import model_tails as mt
    from moe_ar_tools.reference import fp8_group_ref

    tail = mt.build_tail(FAMILY, dtype=torch.bfloat16, device="cuda")
    x, residual = mt.tokens(tail, T, seed=0)
    model = mt.model_output(tail, x, residual)  # (residual + moe(x), next_norm of it), the model's bf16 path
    norm = dict(norm_weight=tail.next_norm.weight.detach(), eps=tail.next_norm.variance_epsilon)
    ok = True
    with dispatch.LocalWorkspace(max_tokens=T, hidden=tail.config.hidden_size, dtype=torch.bfloat16) as ws:
        with torch.no_grad():
            _, weights, experts = tail.router(x)              # weights already times 2.5
            rows = mt.expert_rows(tail.experts, x, experts)   # [T, 8, H], each route unweighted
            shared = tail.shared_expert(x)                    # the shared expert's row
        allreduce_in, idx = mt.permute_by_expert(rows, experts)
        out = dispatch.moe_finalize_allreduce(ws, allreduce_in=allreduce_in, expanded_idx_to_permuted_idx=idx,
                                              expert_scale_factor=weights, routed_scaling_factor=1.0,
                                              shared_expert_output=shared, residual_in=residual, **norm,
                                              quant="fp8_group128")
        case = mt.tail_case(tail, x, residual)                # the same arguments, as the tests build them
        exact = mt.exact_output(case)
        fp8, scales = fp8_group_ref(out.norm_out)
        good = close((out.residual_out, out.norm_out), exact, model) and \
            torch.equal(out.quant_out.view(torch.uint8), fp8.view(torch.uint8)) and torch.equal(out.scale_out, scales)
        print(f"tensor parallel 1, factor folded by the router, fp8_group128: {'ok' if good else 'MISMATCH'}")
        ok &= good

        case = mt.tail_case(tail, x, residual, scaling="op")  # unscaled weights, routed_scaling_factor 2.5
        out = dispatch.moe_finalize_allreduce(ws, **case[0])
        good = close((out.residual_out, out.norm_out), mt.exact_output(case), model)
        print(f"tensor parallel 1, factor applied by the op: {'ok' if good else 'MISMATCH'}")
        ok &= good
        ws.check()

    world = dispatch.EmulatedWorld(4, T, tail.config.hidden_size, torch.bfloat16)
    try:
        case = mt.tail_case(tail, x, residual, world_size=4)  # rank r: its quarter of every expert
        outs = world.run(list(case))
        world.check()
        good = close((outs[0].residual_out, outs[0].norm_out), mt.exact_output(case), model) and all(
            torch.equal(o.norm_out, outs[0].norm_out) for o in outs)
        print(f"tensor parallel 4 (emulated on one GPU): {'ok' if good else 'MISMATCH'}")
        ok &= good
    finally:
        world.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
