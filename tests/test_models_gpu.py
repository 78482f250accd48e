"""The op on the MoE tails of DeepSeek-V3, Qwen3-MoE and Mixtral as their own code computes them
(transformers' modules in bf16 on the GPU, mapped by moe_ar_tools/model_tails.py; the CPU side of the
mapping is tests/test_model_tails_cpu.py).

For each family at its real hidden size and top_k: x and residual; the model's router, experts and
shared expert give the per-route rows, the router's weights and indices and the shared row, which
are fed to the op, at world size 1 (LocalWorkspace) and at world sizes 2, 4 and 8 (EmulatedWorld,
each rank holding its slice of the experts' and the shared expert's intermediate dimension). Every
call is checked as the synthetic-row GPU tests check theirs (the same helpers: outputs poisoned
first, residual_out and norm_out inside the contract's brackets, NVFP4 and FP8 bytes exactly the
rule on the op's own norm_out, ranks bit-identical), in every output profile. As context, the op's
results and the model's own bf16 next_norm(residual + moe(x)) are compared with the exact value of
the same rows: the op within one unit roundoff of bf16 (norm-relative), the model's path within four.
Also the all-to-all combine (top_k 1, weight 1) at world size 1, and the three examples.

    PYTHONPATH=. python3 -m pytest -q -m gpu tests/test_models_gpu.py
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import dispatch  # noqa: E402  (imports without a GPU)
from moe_ar_tools import model_tails as mt  # noqa: E402
from moe_ar_tools import reference as ref  # noqa: E402
from test_gpu_correctness import finish_world, launch_world  # noqa: E402
from test_gpu_world_one import _run_and_check  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICE = "cuda"
DTYPE = torch.bfloat16
U = ref.UNIT_ROUNDOFF[DTYPE]
TOKENS = (1, 7, 64, 300)
MAX_TOKENS = max(TOKENS)
QUANTS = (None, "nvfp4", "fp8_group128", "fp8_tensor")
WORLD_SIZES = (1, 2, 4, 8)

_TAILS = {}


def _tail(family):
    if family not in _TAILS:
        _TAILS[family] = mt.build_tail(family, dtype=DTYPE, device=DEVICE, seed=1)
    return _TAILS[family]


def _rel(a, b) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).norm() / b.norm())


def _check_context(case, out, model_res, model_norm, label):
    """The op's outputs and the model's bf16 path against the exact value of the same rows."""
    exact_res, exact_norm = mt.exact_output(case)
    errors = dict(op_residual=_rel(out.residual_out, exact_res), op_norm=_rel(out.norm_out, exact_norm),
                  model_residual=_rel(model_res, exact_res), model_norm=_rel(model_norm, exact_norm))
    assert errors["op_residual"] <= U and errors["op_norm"] <= U, (label, errors)
    assert errors["model_residual"] <= 4 * U and errors["model_norm"] <= 4 * U, (label, errors)
    return errors


def _plan(family, world_size):
    """(T, quant, scaling, fp8 options) per call: every profile, token counts and both scalings in turn."""
    plan = []
    for i, quant in enumerate(QUANTS):
        T = TOKENS[(i + world_size) % len(TOKENS)]
        scaling = mt.SCALINGS[(i + world_size) % 2] if family == "deepseek_v3" else "router"
        fp8 = dict(fp8_layout=("row", "column")[i % 2], fp8_pow2=world_size % 2 == 0) \
            if quant == "fp8_group128" else {}
        plan.append((T, quant, scaling, fp8))
    return plan


@pytest.fixture(scope="module")
def local_workspaces():
    """local_workspaces(H): one LocalWorkspace per hidden size for the module."""
    made = {}

    def get(H):
        if H not in made:
            made[H] = dispatch.LocalWorkspace(max_tokens=MAX_TOKENS, hidden=H, dtype=DTYPE)
        return made[H]

    yield get
    for ws in made.values():
        ws.close()


@pytest.mark.parametrize("family, world_size", [(f, w) for f in mt.FAMILIES for w in WORLD_SIZES])
def test_model_tail_matches_the_contract(family, world_size, local_workspaces, worlds, seed_for):
    tail = _tail(family)
    H = tail.config.hidden_size
    for i, (T, quant, scaling, fp8) in enumerate(_plan(family, world_size)):
        seed = seed_for(f"tokens{i}")
        x, residual = mt.tokens(tail, T, seed=seed)
        model_res, model_norm = mt.model_output(tail, x, residual)
        case = mt.tail_case(tail, x, residual, world_size=world_size, scaling=scaling, seed=seed)
        label = f"{family} W={world_size} T={T} quant={quant} scaling={scaling}"
        if world_size == 1:
            _, out = _run_and_check(local_workspaces(H), case, quant, label, nvfp4_device=DEVICE, **fp8)
            outs = [out]
        else:
            world = worlds.get(world_size, MAX_TOKENS, H, DTYPE)
            call = launch_world(world, case, quant=quant, nvfp4_device="same", label=label, **fp8)
            finish_world(world, [call])
            outs = call["outs"]
        _check_context(case, outs[0], model_res, model_norm, label)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("family", mt.FAMILIES)
def test_all_to_all_combine_matches_the_contract(family, quant, local_workspaces, seed_for):
    """Attention data parallelism with expert parallelism: the combined row as top_k 1, weight 1."""
    tail = _tail(family)
    seed = seed_for("tokens")
    x, residual = mt.tokens(tail, 64, seed=seed)
    model_res, model_norm = mt.model_output(tail, x, residual)
    case = mt.combined_case(tail, x, residual, seed=seed)
    label = f"{family} combined quant={quant}"
    _, out = _run_and_check(local_workspaces(tail.config.hidden_size), case, quant, label, nvfp4_device=DEVICE)
    _check_context(case, out, model_res, model_norm, label)


@pytest.mark.parametrize("example", ["deepseek_v3_tail.py", "qwen3_moe_tail.py", "mixtral_tail.py"])
def test_model_example_runs_on_one_gpu(example):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, f"examples/{example}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    lines = r.stdout.splitlines()
    assert lines and all(line.endswith(": ok") for line in lines), r.stdout
