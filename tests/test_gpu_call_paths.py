"""The eager call paths on the GPU: a call repeating the last signature (matched against the
workspace's last plan), a call found by its signature, the out-variant torch op and an in-place
residual, each with fresh tensors (new data pointers) every call, every output poisoned and checked
against the float64 reference. Emulated worlds of 2 and 4 ranks on one GPU, each rank calling
dispatch.moe_finalize_allreduce on its own stream, as a process of a real group does."""
from __future__ import annotations


import pytest
import torch

from moe_ar_tools import reference as ref

pytestmark = pytest.mark.gpu

QUANTS = (None, "nvfp4", "fp8_group128", "fp8_tensor")
ROUTES = ("direct", "direct", "out_op", "in_place", "by_signature", "direct")


def _quant_args(quant, r0, dev):
    if quant == "nvfp4":
        v = ref.f32(ref.typical_global_scale(r0["norm_out"]))
        return dict(global_scale=torch.tensor([v], dtype=torch.float32, device=dev)), v
    if quant == "fp8_tensor":
        v = ref.f32(max(float(r0["norm_out"].abs().max()), 1e-3) / ref.E4M3_MAX)
        return dict(fp8_scale=torch.tensor([v], dtype=torch.float32, device=dev)), v
    if quant == "fp8_group128":
        return dict(fp8_scale_layout="column", fp8_pow2_scales=True), None
    return {}, None


def _call(world, streams, route, kwargs):
    """Every rank's call on its own stream, joined back; the outputs of each rank."""
    import dispatch
    outs = []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for ws, s, kw in zip(world.workspaces, streams, kwargs):
        with torch.cuda.stream(s):
            if route == "by_signature":
                ws._moe_ar_state.recent_plans.clear()
            if route == "out_op":
                inputs = [kw[n] for n in ("allreduce_in", "expanded_idx_to_permuted_idx", "residual_in", "norm_weight")]
                outputs = [kw.get(n) for n in ("norm_out", "residual_out", "quant_out", "scale_out")]
                options = {k: v for k, v in kw.items() if k not in ("allreduce_in", "expanded_idx_to_permuted_idx",
                                                                     "residual_in", "norm_weight", "norm_out",
                                                                     "residual_out", "quant_out", "scale_out")}
                torch.ops.moe_ar.moe_finalize_allreduce_out(dispatch.workspace_handle(ws), *inputs, *outputs, **options)
                outs.append(dispatch.MoeFinalizeOutputs(*outputs))
            else:
                outs.append(dispatch.moe_finalize_allreduce(ws, **kw))
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    return outs


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("T", [24, 300])
@pytest.mark.parametrize("quant", QUANTS)
def test_repeated_signature_with_fresh_tensors(ws, T, quant, seed_for, record_result, full_checks):
    import dispatch
    dtype = torch.bfloat16 if T == 24 else torch.float16
    H, K = 2048, 6
    world = dispatch.EmulatedWorld(ws, 512, H, dtype, timeout_s=10.0)
    streams = [torch.cuda.Stream() for _ in range(ws)]
    info = dict(program=f"call paths ws{ws} T{T} {quant}", cases=0)
    try:
        for i, route in enumerate(ROUTES):
            # the same shapes, dtypes and scalars every call: one signature; new tensors every call
            case = ref.make_case(ws, T, H, K, dtype, seed=seed_for(f"call{i}"), device="cuda", shared=True,
                                 scale_kind="fp32", rsf=1.0, weight_bias=0, padded_rows=3, drop_frac=0.1)
            pristine = ref.Case([dict(kw, residual_in=kw["residual_in"].clone()) for kw in case], case.meta)
            r0 = ref.reference_for(pristine)
            qargs, scale = _quant_args(quant, r0, "cuda")
            provided = ref.alloc_outputs(case, quant, extra_scale_bytes=0,
                                         fp8_scale_layout=qargs.get("fp8_scale_layout", "row"))
            kwargs = []
            for kw, p in zip(case, provided):
                if route == "in_place":
                    p["residual_out"] = kw["residual_in"]
                kwargs.append(dict(kw, **p, **qargs, quant=quant))
            outs = _call(world, streams, route, kwargs)
            torch.cuda.synchronize()
            world.check()
            ref.check_outputs(pristine, outs, provided, quant=quant, global_scale=scale, ref=r0,
                              nvfp4_device=r0["norm_out"].device, label=f"call {i} ({route})",
                              **(qargs if quant == "fp8_group128" else {}))
            info["cases"] += 1
        # one full check per rank per signature: the direct calls' and the out op's (which passes every option)
        assert full_checks[0] == 2 * ws, full_checks[0]
        record_result(**info, passed=True)
    except BaseException as e:
        record_result(**info, passed=False, error=str(e)[:2000])
        raise
    finally:
        world.close()
