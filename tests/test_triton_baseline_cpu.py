"""The Triton baselines (moe_ar_tools.baselines.triton_fused) held to the same float64 contract as the
programs, in Triton's interpreter on the CPU: a benchmark row is only a baseline if it computes the
same tail. Runs in a subprocess because TRITON_INTERPRET must be set before the kernels are jitted;
skipped where Triton is not installed."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

_SCRIPT = r"""
import sys
import types
import torch
from moe_ar_tools.baselines import triton_fused as tf
from moe_ar_tools.reference import cases, checks

seed, device, dtypes = int(sys.argv[1]), sys.argv[2], [getattr(torch, d) for d in sys.argv[3].split(",")]
fp8_bytes = sys.argv[4] == "1"  # hold quant_out and scale_out to the rule too
# (tokens, hidden, top_k, scale kind, shared, quant, path)
grid = [
    (5, 256, 8, "fp32", True, None, "fused"),
    (3, 384, 2, None, False, None, "fused"),          # H not a power of two: masked lanes
    (4, 512, 4, "dtype", True, "fp8_group128", "fused"),
    (2, 320, 8, "fp32", True, "fp8_tensor", "fused"),
    (4, 256, 8, "fp32", True, "fp8_group128", "chain"),
    (3, 200, 2, None, True, None, "chain"),
]
for n, (dt, (T, H, K, sk, sh, q, path)) in enumerate((dt, g) for dt in dtypes for g in grid):
    case = cases.make_case(1, T, H, K, dt, seed=seed + n, scale_kind=sk, shared=sh, rsf=1.7, padded_rows=3,
                           drop_frac=0.2, eps=1e-6, device=device)
    kw = case[0]
    provided = checks.alloc_outputs(case, q)
    outs = provided[0]
    args = (kw["allreduce_in"], kw["expanded_idx_to_permuted_idx"], kw["expert_scale_factor"],
            kw["shared_expert_output"])
    fp8_scale = None
    gs = None
    if q == "fp8_tensor":
        ref_norm = cases.reference_for(case)["norm_out"]
        gs = float(torch.tensor(float(ref_norm.double().abs().max()) * 2 / 448, dtype=torch.float32))
        fp8_scale = torch.tensor([gs], dtype=torch.float32, device=device)  # x / scale: half of E4M3's range
    if path == "fused":
        tf.fused(outs, *args, kw["residual_in"], kw["norm_weight"], eps=kw["eps"],
                 routed_scaling_factor=kw["routed_scaling_factor"], quant=q, fp8_scale=fp8_scale)
    else:
        partial = torch.full((T, H), float("nan"), dtype=dt, device=device)
        tf.gather_sum(partial, *args, routed_scaling_factor=kw["routed_scaling_factor"])
        tf.add_rmsnorm(outs, partial, kw["residual_in"], kw["norm_weight"], eps=kw["eps"], quant=q,
                       fp8_scale=fp8_scale)
        # the chain rounds the partial to the dtype first (the engines' two-kernel path, not the one
        # rounding of the contract): the partial is held to the bracket of the tail without a residual,
        # the second kernel to the tail whose only input is that partial
        no_residual = dict(kw, residual_in=torch.zeros_like(kw["residual_in"]))
        alone = cases.reference_for(cases.Case([no_residual], case.meta))
        p64 = partial.double()
        assert ((alone["residual_lo"].double() <= p64) & (p64 <= alone["residual_hi"].double())).all(), "partial"
        no_routes = torch.full_like(kw["expanded_idx_to_permuted_idx"], -1)
        case = cases.Case([dict(kw, expanded_idx_to_permuted_idx=no_routes, shared_expert_output=partial)], case.meta)
    checked = dict(outs) if fp8_bytes else {k: outs[k] for k in ("residual_out", "norm_out")}
    checks.check_outputs(case, [types.SimpleNamespace(**{"quant_out": None, "scale_out": None, **checked})],
                         [checked], quant=q if fp8_bytes else None, global_scale=gs, label=path)
    print("ok", path, case.describe(), q)
"""


def _run(seed: int, device: str, dtypes: str, interpret: bool):
    """The grid in a subprocess; on the GPU the FP8 bytes and scales are checked too."""
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(seed), device, dtypes, "0" if interpret else "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == 6 * len(dtypes.split(",")), r.stdout


def test_triton_baselines_meet_the_float64_contract_interpreted(seed_for):
    # fp16 only, and the FP8 bytes left to the GPU test: the interpreter converts to bfloat16 and to
    # E4M3 by truncation, not round-to-nearest-even
    _run(seed_for("triton") % (1 << 30), "cpu", "float16", interpret=True)


@pytest.mark.gpu
def test_triton_baselines_meet_the_float64_contract_on_the_gpu(seed_for):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    _run(seed_for("triton") % (1 << 30), "cuda", "float16,bfloat16", interpret=False)


def test_triton_baseline_refuses_a_bad_quant_and_a_ragged_group():
    from moe_ar_tools.baselines import triton_fused as tf
    with pytest.raises(ValueError, match="quant"):
        tf.outputs(2, 256, None, "nvfp4", "cpu")
    with pytest.raises(ValueError, match="hidden"):
        tf.outputs(2, 200, None, "fp8_group128", "cpu")
