"""The model families' tails mapped onto the op (moe_ar_tools/model_tails.py), checked on the CPU
against the models' own code: transformers' DeepseekV3MoE, Qwen3MoeSparseMoeBlock and
MixtralSparseMoeBlock with their RMSNorms, at the real hidden sizes and top_k (few experts, a small
intermediate size, random weights).

What is checked:
  * float64: next_norm(residual + moe(x)) as the model computes it equals the op's math (the float64
    sum of every rank's partial plus residual_in, RMSNorm) on the mapped inputs, at world sizes 1, 2,
    4 and 8 and with DeepSeek-V3's routed_scaling_factor applied by its router or by the op; the
    models' RMSNorm runs in float32 whatever the input (it casts), so norm_out agrees to float32;
  * tensor parallelism: each rank's partial (its slices of the experts and of the shared expert) is
    a real part, and the partials sum to the layer's output;
  * bf16: the model's own bf16 path and the contract's rounded results both lie within a few unit
    roundoffs of the exact value of the same rows (the model's path is context, not the bound);
  * the all-to-all combine of attention data parallelism: one summed row per token, top_k 1, weight 1;
  * what the routers do (the mapping's assumptions): DeepSeek-V3 folds routed_scaling_factor into
    weights that sum to it, Qwen3-MoE (norm_topk_prob) and Mixtral renormalize to 1;
  * that the comparison fails for wrong mappings: the factor folded twice, the shared expert left
    out or counted on every rank, no renormalization, the (1 + gamma) norm;
  * the mapping refuses what the op cannot express, naming it.
"""
from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

pytest.importorskip("transformers")

from moe_ar_tools import model_tails as mt  # noqa: E402
from moe_ar_tools import reference as ref  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENS = 8
U_BF16 = ref.UNIT_ROUNDOFF[torch.bfloat16]
U_F32 = 2.0 ** -24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread for the module: the models' many small expert GEMMs and index_add_ calls run
    far slower when two threads contend with the machine's other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rel(a, b) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).norm() / b.norm())


_TAILS = {}


def _tail(family, dtype):
    """One tail per (family, dtype) for the module (building DeepSeek-V3's takes a second)."""
    key = (family, dtype)
    if key not in _TAILS:
        _TAILS[key] = mt.build_tail(family, dtype=dtype, seed=7)
    return _TAILS[key]


def _errors(case, model_res, model_norm):
    """(residual_out, norm_out) norm-relative distances of the op's float64 math from the model's."""
    res, norm = mt.exact_output(case)
    return _rel(res, model_res), _rel(norm, model_norm)


@pytest.mark.parametrize("scaling", mt.SCALINGS)
@pytest.mark.parametrize("world_size", (1, 2, 4, 8))
@pytest.mark.parametrize("family", mt.FAMILIES)
def test_float64_mapping_equals_the_model(family, world_size, scaling):
    tail = _tail(family, torch.float64)
    x, residual = mt.tokens(tail, TOKENS, seed=world_size)
    model_res, model_norm = mt.model_output(tail, x, residual)
    case = mt.tail_case(tail, x, residual, world_size=world_size, scaling=scaling)
    assert len(case) == world_size and case.meta["top_k"] == mt.REAL[family]["top_k"]
    assert case.meta["hidden"] == mt.REAL[family]["hidden"]
    # The router's float32 weights times 2.5 (router) or the op's rsf times the float64 sum (op):
    # one float32 rounding of each weight apart.
    res_tol = 1e-13 if scaling == "router" or family != "deepseek_v3" else 4 * U_F32
    res_err, norm_err = _errors(case, model_res, model_norm)
    assert res_err <= res_tol, (family, world_size, scaling, res_err)
    assert norm_err <= 8 * U_F32, (family, world_size, scaling, norm_err)  # the model normalizes in float32


@pytest.mark.parametrize("family", mt.FAMILIES)
def test_tensor_parallel_partials_are_parts_that_sum_to_the_layer(family):
    tail = _tail(family, torch.float64)
    x, residual = mt.tokens(tail, TOKENS, seed=11)
    layer = tail.moe(x.unsqueeze(0)).squeeze(0)
    for world_size in (2, 4, 8):
        case = mt.tail_case(tail, x, residual, world_size=world_size)
        partials = [ref.finalize_partial(kw["allreduce_in"], kw["expanded_idx_to_permuted_idx"],
                                         kw["expert_scale_factor"], kw["routed_scaling_factor"],
                                         kw["shared_expert_output"]) for kw in case]
        assert _rel(sum(partials), layer) <= 1e-13, (family, world_size)
        for r, p in enumerate(partials):  # each is a real part, not the whole nor nothing
            assert 0.2 < _rel(p, layer) < 1.2, (family, world_size, r, _rel(p, layer))
        # replicated on every rank: routing, weights, residual, norm
        for kw in case[1:]:
            for name in ("expanded_idx_to_permuted_idx", "expert_scale_factor", "residual_in", "norm_weight"):
                assert torch.equal(kw[name], case[0][name]), name


@pytest.mark.parametrize("world_size", (1, 4))
@pytest.mark.parametrize("family", mt.FAMILIES)
def test_bf16_model_and_contract_agree_with_the_exact_value(family, world_size):
    """The model's bf16 path rounds after every step (each weighted row, each add, the norm before
    gamma); the contract rounds once a stage. Both are within a few unit roundoffs of the exact
    value of the same bf16 rows."""
    tail = _tail(family, torch.bfloat16)
    x, residual = mt.tokens(tail, TOKENS, seed=3)
    model_res, model_norm = mt.model_output(tail, x, residual)
    case = mt.tail_case(tail, x, residual, world_size=world_size)
    r0 = ref.reference_for(case)
    assert _rel(r0["residual_out"], r0["residual_out_f64"]) <= U_BF16
    assert _rel(r0["norm_out"], r0["norm_out_f64"]) <= U_BF16
    assert _rel(model_res, r0["residual_out_f64"]) <= 4 * U_BF16
    assert _rel(model_norm, r0["norm_out_f64"]) <= 4 * U_BF16


@pytest.mark.parametrize("family", mt.FAMILIES)
def test_the_all_to_all_combine_is_top_k_one_with_weight_one(family):
    """Expert parallelism: the combine's weighted sum per token as one route, plus the shared expert."""
    tail = _tail(family, torch.float64)
    x, residual = mt.tokens(tail, TOKENS, seed=17)
    model_res, model_norm = mt.model_output(tail, x, residual)
    case = mt.combined_case(tail, x, residual)
    assert case[0]["expanded_idx_to_permuted_idx"].shape == (TOKENS, 1) and case[0]["expert_scale_factor"] is None
    res_err, norm_err = _errors(case, model_res, model_norm)
    assert res_err <= 1e-13 and norm_err <= 8 * U_F32, (family, res_err, norm_err)


def test_what_the_routers_return():
    """The mapping's assumptions, read off the routers' outputs in float64."""
    x = {}
    for family in mt.FAMILIES:
        tail = _tail(family, torch.float64)
        x[family], _ = mt.tokens(tail, TOKENS, seed=5)
    ds = _tail("deepseek_v3", torch.float64)
    w, idx, rsf = mt.route(ds, x["deepseek_v3"], scaling="router")
    assert rsf == 1.0 and w.dtype == torch.float32 and idx.shape == (TOKENS, 8)
    assert torch.allclose(w.sum(-1).double(), torch.full((TOKENS,), 2.5, dtype=torch.float64), rtol=1e-6)
    w1, idx1, rsf1 = mt.route(ds, x["deepseek_v3"], scaling="op")
    assert rsf1 == 2.5 and torch.equal(idx1, idx) and ds.router.routed_scaling_factor == 2.5
    assert torch.allclose(w1.sum(-1).double(), torch.ones(TOKENS, dtype=torch.float64), rtol=1e-6)
    # the score-correction bias chooses experts; the weights are the plain sigmoid scores
    logits = torch.nn.functional.linear(x["deepseek_v3"].float(), ds.router.weight.float())
    scores = logits.sigmoid().gather(1, idx1.long())
    assert torch.allclose(w1, scores / scores.sum(-1, keepdim=True), rtol=1e-6)
    for family in ("qwen3_moe", "mixtral"):
        tail = _tail(family, torch.float64)
        w, idx, rsf = mt.route(tail, x[family])
        assert rsf == 1.0 and idx.shape == (TOKENS, mt.REAL[family]["top_k"])
        assert torch.allclose(w.sum(-1).double(), torch.ones(TOKENS, dtype=torch.float64)), family
        assert tail.shared_expert is None
    with pytest.raises(ValueError, match="scaling"):
        mt.route(ds, x["deepseek_v3"], scaling="both")


def _replace(case, **changes):
    """A Case with every rank's arguments changed (a value, or a function of the rank's dict)."""
    ranks = []
    for r, kw in enumerate(case):
        kw = dict(kw)
        for name, v in changes.items():
            kw[name] = v(r, kw) if callable(v) else v
        ranks.append(kw)
    return ref.Case(ranks, dict(case.meta))


def test_a_wrong_mapping_is_detected():
    """The same comparison as test_float64_mapping_equals_the_model fails, by far, for each mistake."""
    def far(case, model):
        res_err, norm_err = _errors(case, *model)
        return res_err > 1e-3 or norm_err > 1e-3

    ds = _tail("deepseek_v3", torch.float64)
    x, residual = mt.tokens(ds, TOKENS, seed=13)
    model = mt.model_output(ds, x, residual)
    good = mt.tail_case(ds, x, residual, world_size=2)
    assert not far(good, model)
    assert far(_replace(good, routed_scaling_factor=2.5), model)              # the factor folded twice
    assert far(_replace(good, shared_expert_output=None), model)             # the shared expert left out
    full_shared = ds.shared_expert(x)
    assert far(_replace(good, shared_expert_output=full_shared), model)      # unsplit on every rank: counted twice
    assert far(_replace(good, weight_bias=1), model)                         # a (1 + gamma) norm
    unscaled = mt.tail_case(ds, x, residual, world_size=2, scaling="op")
    assert not far(unscaled, model)
    assert far(_replace(unscaled, routed_scaling_factor=1.0), model)        # the factor never applied

    qwen = _tail("qwen3_moe", torch.float64)
    x, residual = mt.tokens(qwen, TOKENS, seed=13)
    model = mt.model_output(qwen, x, residual)
    good = mt.tail_case(qwen, x, residual)
    assert not far(good, model)
    qwen.router.norm_topk_prob = False  # the router's top-k softmax probabilities, not renormalized
    try:
        plain, _, _ = mt.route(qwen, x)
    finally:
        qwen.router.norm_topk_prob = True
    assert far(_replace(good, expert_scale_factor=plain), model)

    mixtral = _tail("mixtral", torch.float64)
    x, residual = mt.tokens(mixtral, TOKENS, seed=13)
    model = mt.model_output(mixtral, x, residual)
    good = mt.tail_case(mixtral, x, residual, world_size=4)
    assert not far(good, model)
    logits = torch.nn.functional.linear(x, mixtral.router.weight)
    probs = logits.float().softmax(-1)
    _, idx, _ = mt.route(mixtral, x)
    assert far(_replace(good, expert_scale_factor=probs.gather(1, idx)), model)  # softmax top-2, not renormalized


def test_the_mapping_refuses_what_the_op_cannot_express():
    tail = _tail("mixtral", torch.float64)
    with pytest.raises(ValueError, match="world_size"):
        mt.split_for_tensor_parallel(tail, 3)  # 64 does not split in 3
    experts = tail.experts
    experts.has_bias = True  # transformers marks experts whose GEMMs add a bias (none of the three)
    try:
        with pytest.raises(ValueError, match="experts: a bias"):
            mt._check_expressible("mixtral", tail.moe, tail.next_norm)
    finally:
        experts.has_bias = False
    weight = tail.next_norm.weight
    tail.next_norm.weight = None
    try:
        with pytest.raises(ValueError, match="norm_weight"):
            mt._check_expressible("mixtral", tail.moe, tail.next_norm)
    finally:
        tail.next_norm.weight = weight
    with pytest.raises(ValueError, match="family"):
        mt.build_tail("llama")


def test_permute_by_expert_sorts_rows_by_expert():
    indices = torch.tensor([[3, 1], [1, 0], [3, 2]])
    rows = torch.arange(12, dtype=torch.float64).view(3, 2, 2)
    permuted, idx = mt.permute_by_expert(rows, indices)
    assert idx.dtype == torch.int32
    experts = indices.reshape(-1)[torch.argsort(indices.reshape(-1), stable=True)]
    assert experts.tolist() == sorted(experts.tolist())
    for t in range(3):
        for k in range(2):
            assert torch.equal(permuted[idx[t, k]], rows[t, k])


EXAMPLES = {"deepseek_v3": "examples/deepseek_v3_tail.py", "qwen3_moe": "examples/qwen3_moe_tail.py",
            "mixtral": "examples/mixtral_tail.py"}


@pytest.mark.parametrize("family", mt.FAMILIES)
def test_each_family_has_an_example_that_imports_without_a_gpu(family):
    """One example per family (run on a GPU by tests/test_models_gpu.py): it parses, names its family,
    does its GPU work in main() only, and says how to run it."""
    path = ROOT / EXAMPLES[family]
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert f"python examples/{path.name}" in doc
    assert f'"{family}"' in path.read_text()
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    assert 'if __name__ == "__main__":' in path.read_text()


def test_tail_case_meta_is_what_the_reference_reads():
    tail = _tail("qwen3_moe", torch.bfloat16)
    x, residual = mt.tokens(tail, 3, seed=1)
    case = mt.tail_case(tail, x, residual, world_size=2)
    for kw in case:  # the op's keyword arguments, nothing else
        assert set(kw) == {"allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor",
                           "routed_scaling_factor", "shared_expert_output", "residual_in", "norm_weight", "eps",
                           "weight_bias"}
        assert kw["allreduce_in"].dtype == torch.bfloat16 and kw["allreduce_in"].shape == (3 * 8, 2048)
        assert kw["eps"] == 1e-6 and kw["weight_bias"] == 0
    assert "W=2 T=3 H=2048 K=8" in case.describe()
    assert math.isclose(case.meta["rsf"], 1.0)
