"""The harness's parts shared by every world size, and world size 2+'s (moe_ar_tools/bench/,
multi_gpu/), on CPU: roofline byte counts, statistics and the one percentile, the record format and
the header, option parsing and the one command for every world size, the summary, the writes and
the plot, and the torch pieces that run the same on CPU (the unfused baseline's math, the float64
contract outputs it checks against). World size 1's parts: tests/test_bench_world_one_cpu.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import dispatch
from moe_ar_tools.bench import cli, config, inputs, records, roofline, timing
from moe_ar_tools.bench.outputs import poison
from moe_ar_tools.bench.multi_gpu import config as multi_config
from moe_ar_tools.bench.multi_gpu import point, summary, systems
from moe_ar_tools import reference as ref


# ---- roofline byte counts, by hand --------------------------------------------------------------

def test_hbm_bytes_small_case_by_hand():
    # T=2 tokens, H=32, top_k=3, shared expert, bf16 (2 bytes), profile 110
    b = roofline.hbm_bytes(2, 32, 3, True, "plain", 2)
    assert b["expert_rows"] == 2 * 3 * 32 * 2 == 384
    assert b["routing"] == 2 * 3 * (4 + 4) == 48  # int32 index + fp32 router weight per route
    assert b["shared"] == 2 * 32 * 2 == 128
    assert b["residual"] == 128
    assert b["norm_weight"] == 32 * 2 == 64
    assert b["outputs"] == 2 * 2 * 32 * 2 == 256  # residual_out and norm_out
    assert b["nvfp4"] == 0
    assert b["total"] == 384 + 48 + 128 + 128 + 64 + 256 == 1008


def test_hbm_bytes_nvfp4_no_shared_and_dropped_routes():
    b = roofline.hbm_bytes(2, 32, 3, False, "nvfp4", 2, dropped_routes=2)
    assert b["shared"] == 0
    assert b["expert_rows"] == (6 - 2) * 32 * 2 == 256  # dropped routes read no row
    # quant_out T*H/2 = 32 bytes; scales: rows padded to 128, H/16 = 2 columns padded to 4 -> 512
    assert b["nvfp4"] == 32 + 128 * 4 == 544
    assert b["total"] == 256 + 48 + 0 + 128 + 64 + 256 + 544


def test_hbm_bytes_deepseek_shape():
    T, H, K = 16384, 7168, 8
    b = roofline.hbm_bytes(T, H, K, True, "plain")
    assert b["total"] == T * K * H * 2 + T * K * 8 + T * H * 2 * 4 + H * 2


def test_hbm_bytes_nvfp4_scales_are_the_runtimes_scale_out_bytes():
    for T, H in [(1, 16), (129, 7168), (16384, 7168)]:
        b = roofline.hbm_bytes(T, H, 8, False, "nvfp4")
        assert b["nvfp4"] == T * H // 2 + dispatch.scale_out_bytes(T, H)


def test_nvlink_bytes_by_regime():
    payload = 2 * 32 * 2  # T=2, H=32, bf16
    assert roofline.nvlink_bytes(2, 32, 2, "one_shot") == 1 * payload
    assert roofline.nvlink_bytes(2, 32, 2, "two_shot") == payload  # 2 * (W-1)/W = 1 at W=2
    assert roofline.nvlink_bytes(2, 32, 4, "one_shot") == 3 * payload
    assert roofline.nvlink_bytes(2, 32, 4, "two_shot") == 1.5 * payload
    assert roofline.nvlink_bytes(2, 32, 8, "two_shot") == 1.75 * payload
    with pytest.raises(ValueError):
        roofline.nvlink_bytes(2, 32, 2, "multicast")


def test_roofline_is_the_larger_time():
    r = roofline.roofline(4.2e9, 390e6, 4200.0, 390.0)  # 1 ms of HBM, 1 ms of NVLink
    assert r["hbm_us"] == pytest.approx(1000.0)
    assert r["nvlink_us"] == pytest.approx(1000.0)
    r = roofline.roofline(4.2e9, 780e6, 4200.0, 390.0)
    assert r["roofline_us"] == pytest.approx(2000.0) and r["bound"] == "nvlink"
    r = roofline.roofline(8.4e9, 390e6, 4200.0, 390.0)
    assert r["roofline_us"] == pytest.approx(2000.0) and r["bound"] == "hbm"


def test_regime_of_family():
    assert roofline.regime_of_family("oneshot") == "one_shot"
    for fam in ("twoshot", "twoshot_early", "twoshot_shared", "twoshot_early_shared"):
        assert roofline.regime_of_family(fam) == "two_shot"


# ---- statistics ----------------------------------------------------------------------------------

def test_median_percentile():
    assert timing.median([3, 1, 2]) == 2
    assert timing.median([4, 1, 2, 3]) == 2.5
    assert timing.percentile([1, 2, 3, 4, 5], 0) == 1
    assert timing.percentile([1, 2, 3, 4, 5], 100) == 5
    assert timing.percentile([1, 2, 3, 4, 5], 25) == 2
    assert timing.percentile([10, 20], 50) == 15
    with pytest.raises(ValueError):
        timing.median([])


def test_pair_ratio_is_median_of_per_replay_ratios():
    assert timing.pair_ratio([1.0, 2.0, 30.0], [2.0, 2.0, 10.0]) == 1.0  # ratios 0.5, 1, 3
    # not the ratio of the medians: here the per-replay ratios are 1, 0.25, 2.5 (median 1),
    # while median(a) / median(b) = 1 / 4
    a, b = [1.0, 1.0, 10.0], [1.0, 4.0, 4.0]
    assert timing.pair_ratio(a, b) == 1.0
    assert timing.median(a) / timing.median(b) == 0.25
    with pytest.raises(ValueError):
        timing.pair_ratio([1.0], [1.0, 2.0])


def test_replay_orders_interleave_every_system_once_a_round_in_varying_order():
    n, rounds = 5, 200
    orders = timing.replay_orders(n, rounds, seed=1234)
    assert len(orders) == rounds
    assert all(sorted(o) == list(range(n)) for o in orders)  # interleaved: each system once a round
    # no fixed place or neighbour: every system comes first in some round, and the system
    # before system 0 within a round is not always the same one
    assert {o[0] for o in orders} == set(range(n))
    before_0 = {o[o.index(0) - 1] for o in orders if o.index(0) > 0}
    assert len(before_0) == n - 1
    # every rank computes the same sequence from the same seed; another seed gives another
    assert timing.replay_orders(n, rounds, seed=1234) == orders
    assert timing.replay_orders(n, rounds, seed=99) != orders
    assert timing.replay_orders(1, 3, seed=0) == [[0], [0], [0]]
    with pytest.raises(ValueError, match="rounds"):
        timing.replay_orders(3, 0, seed=0)


def test_slowest_rank_takes_max_per_replay():
    assert timing.slowest_rank([[1, 5, 3], [2, 4, 3]]) == [2, 5, 3]


def test_input_sets_for():
    L2 = 50 * 2 ** 20
    assert timing.input_sets_for(1, L2, 10) == 10  # tiny sets: one per captured call
    assert timing.input_sets_for(10 * L2, L2, 10) == 1  # huge sets: one
    per_set = 36_700_160  # T=256, H=7168, K=8, shared + residual
    n = timing.input_sets_for(per_set, L2, 10)
    assert n * per_set >= 2 * L2 and (n - 1) * per_set < 2 * L2


def test_cold_input_sets_fill_three_times_the_l2_whatever_the_calls():
    L2 = 60 * 2 ** 20
    per_set = (8 + 2 + 2) * 7168 * 2  # one token of H 7168, top_k 8 + shared: read and written
    n = timing.cold_input_sets(per_set, L2)
    assert n * per_set > 3 * L2 - per_set and (n - 1) * per_set < 3 * L2 and n > 1000
    assert timing.cold_input_sets(10 * L2, L2) == 1 and timing.cold_input_sets(1, L2) == timing.MAX_COLD_SETS


# ---- records -------------------------------------------------------------------------------------

def _record(**kw):
    base = dict(system="auto", world_size=2, dtype="bf16", hidden=7168, top_k=8, shared=True, profile="plain",
                tokens=64, median_us=12.5, roofline_us=3.25, valid=True)
    base.update(kw)
    return records.make_record(**base)


def test_record_schema():
    r = _record(ratio_vs_nccl_torch=0.5, program="moe_ar_oneshot_bf16_ws2_plain")
    assert tuple(r)[:len(records.RECORD_KEYS)] == records.RECORD_KEYS
    assert r["emulated"] is False
    assert r["ratio_vs_nccl_torch"] == 0.5 and r["program"] == "moe_ar_oneshot_bf16_ws2_plain"
    json.dumps(r)
    # a voided leg keeps its time, flagged
    assert _record(valid=False)["valid"] is False
    assert _record(valid=False, median_us=None)["median_us"] is None


@pytest.mark.parametrize("bad", [dict(system=""), dict(dtype="fp32"), dict(profile="112"), dict(tokens=0),
                                 dict(hidden=7168.0), dict(top_k=True), dict(median_us=-1.0),
                                 dict(median_us=None)])  # the last: valid but no time
def test_record_rejects_bad_fields(bad):
    with pytest.raises(ValueError):
        _record(**bad)


def test_jsonable_makes_strict_json():
    out = records.jsonable({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}})
    assert out == {"a": None, "b": [1.0, None], "c": {"d": 2}}
    json.dumps(out, allow_nan=False)


# ---- summary -------------------------------------------------------------------------------------

def test_summary_picks_best_and_reports_ratios():
    recs = [
        _record(system="nccl+torch", median_us=40.0),
        _record(system="symm+torch", variant="one_shot", median_us=30.0),
        _record(system="symm+torch", variant="two_shot", median_us=35.0),
        _record(system="moe_ar_oneshot_bf16_ws2_plain", median_us=12.0),
        _record(system="moe_ar_twoshot_bf16_ws2_plain", median_us=9.0, valid=False),  # faster but wrong: ignored
        _record(system="moe_ar_twoshot_early_bf16_ws2_plain", median_us=14.0),
        _record(system="auto", median_us=12.5, program="moe_ar_oneshot_bf16_ws2_plain", ratio_vs_nccl_torch=0.31,
                ratio_vs_symm_torch=0.42, ratio_vs_best_program=1.04),
    ]
    rows = summary.summary_rows(recs)
    assert len(rows) == 1
    r = rows[0]
    assert r["auto_us"] == 12.5 and r["nccl_torch_us"] == 40.0
    assert r["symm_torch_us"] == 30.0 and r["symm_variant"] == "one_shot"
    assert r["best_program"] == "moe_ar_oneshot_bf16_ws2_plain" and r["best_program_us"] == 12.0
    assert r["auto_vs_nccl"] == 0.31 and r["auto_vs_best"] == 1.04
    assert r["roofline_fraction"] == pytest.approx(3.25 / 12.5)
    assert r["invalid"] == ["moe_ar_twoshot_bf16_ws2_plain"]
    text = summary.format_summary(rows)
    assert "7168/8s" in text and "oneshot;oneshot" in text and "INVALID:twoshot" in text and "0.31" in text


def test_summary_reports_the_strongest_baseline():
    recs = [
        _record(system="nccl+torch", median_us=40.0),
        _record(system="symm+torch", variant="two_shot", median_us=30.0),
        _record(system="nccl+compiled", median_us=25.0),
        _record(system="symm+compiled", variant="one_shot", median_us=21.0),
        _record(system="symm+compiled", variant="two_shot", median_us=18.0, valid=False),  # wrong: ignored
        _record(system="auto", median_us=7.0, ratio_vs_best_baseline=0.33),
    ]
    r = summary.summary_rows(recs)[0]
    assert r["nccl_compiled_us"] == 25.0 and r["symm_compiled_us"] == 21.0
    assert r["best_baseline"] == "symm+compiled/one_shot" and r["best_baseline_us"] == 21.0
    assert r["auto_vs_best_baseline"] == 0.33
    text = summary.format_summary([r])
    assert "symm+compiled/one_shot" in text and "0.33" in text
    # the fused-quant baseline is not an unfused step: never the best baseline
    r = summary.summary_rows([_record(system="auto+quant", profile="fp8_tensor", median_us=1.0),
                              _record(system="nccl+torch", profile="fp8_tensor", median_us=9.0)])[0]
    assert r["best_baseline"] == "nccl+torch"
    assert set(multi_config.UNFUSED_BASELINES) <= set(multi_config.BASELINES) <= \
        set(multi_config.SYSTEM_CHOICES) | {"auto+quant"}
    assert {"nccl+compiled", "symm+compiled"} <= set(config.parse_list(multi_config.DEFAULT_SYSTEMS))


def test_summary_order_follows_the_sweep():
    recs = [_record(hidden=7168, tokens=2), _record(hidden=7168, tokens=1), _record(hidden=4096, tokens=1),
            _record(hidden=7168, tokens=1, profile="nvfp4")]
    keys = [(r["hidden"], r["profile"], r["tokens"]) for r in summary.summary_rows(recs)]
    assert keys == [(7168, "plain", 1), (7168, "plain", 2), (7168, "nvfp4", 1), (4096, "plain", 1)]


def test_short_program():
    assert summary.short_program("moe_ar_twoshot_early_shared_fp16_ws8_nvfp4") == "twoshot_early_shared"
    assert summary.short_program("moe_ar_local_bf16_ws1_fp8_group128") == "local"
    assert summary.short_program("nccl+torch") == "nccl+torch"
    assert summary.short_program(None) == "-"


# ---- parsing and the command line ----------------------------------------------------------------

def test_defaults_are_the_documented_shape_table():
    shapes = config.parse_shapes(config.DEFAULT_SHAPES)
    assert shapes == [config.Shape(7168, 8, True), config.Shape(7168, 8, False), config.Shape(7168, 4, True),
                      config.Shape(4096, 8, False)]
    assert config.parse_tokens(config.DEFAULT_TOKENS) == [2 ** i for i in range(15)]


def test_parse_tokens_and_shapes():
    assert config.parse_tokens("1-16") == [1, 2, 4, 8, 16]
    assert config.parse_tokens("64,3,64") == [3, 64]
    for bad in ("", "0", "-3"):
        with pytest.raises(ValueError):
            config.parse_tokens(bad)
    for bad in ("7168", "7168:8:yes", "100:8", "7168:0", ""):
        with pytest.raises(ValueError):
            config.parse_shapes(bad)
    with pytest.raises(ValueError):
        config.parse_list("110,112", config.PROFILES, "profile")


def test_cli_rejects_bad_options_without_a_gpu():
    runner = CliRunner()
    assert runner.invoke(cli.main, ["--help"]).exit_code == 0
    r = runner.invoke(cli.main, ["--shapes", "7168:8:nope"])
    assert r.exit_code == 2 and "HIDDEN:TOP_K" in r.output
    r = runner.invoke(cli.main, ["--systems", "auto,not_a_program"])
    assert r.exit_code == 2 and "not_a_program" in r.output


def test_cli_accepts_the_compiled_baselines(monkeypatch):
    """--systems takes the +compiled names; the run then stops at the GPU count (none here)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    r = CliRunner().invoke(cli.main, ["--systems", "nccl+compiled,symm+compiled,nccl+torch", "--reps", "50"])
    assert r.exit_code == 1 and "needs 2 GPUs" in r.output, r.output
    assert "not one of" not in r.output


def test_default_out_path():
    import datetime
    p = records.default_out_path("2xH200 / host", datetime.datetime(2025, 1, 2, 3, 4, 5))
    assert str(p) == "bench_results/2xH200_host-20250102-030405.json"


def test_import_works_without_a_gpu_and_plots_lazily():
    code = "import sys, moe_ar_tools.bench, moe_ar_tools.bench.cli; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_percentile():
    """The harness and the tools define one percentile (moe_ar_tools/bench/timing.py) and one median."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent / "moe_ar_tools"
    defined = sorted(f"{p.relative_to(root)}:{node.name}" for p in root.rglob("*.py")
                     for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, ast.FunctionDef) and re.fullmatch(r"_?(percentile|quantile|median)", node.name))
    assert defined == ["bench/timing.py:median", "bench/timing.py:percentile"], defined


# ---- the unfused baseline's torch math -----------------------------------------------------------

def test_torch_baseline_matches_float64_on_cpu():
    shape = config.Shape(64, 4, True)
    T = 5
    x = inputs.make_input_sets(shape, T, 1, torch.bfloat16, rank=0, seed=3, device="cpu")[0]
    partial = torch.empty(T, 64, dtype=torch.bfloat16)
    systems.torch_finalize(x, partial)
    exact = torch.zeros(T, 64, dtype=torch.float64)
    for t in range(T):
        for k in range(4):
            exact[t] += float(x.scale[t, k]) * x.allreduce_in[int(x.idx[t, k])].double()
    exact = exact * config.ROUTED_SCALING_FACTOR + x.shared.double()
    assert inputs.rel_err(partial, exact.float()) < 4 * ref.UNIT_ROUNDOFF[torch.bfloat16]

    out = {"residual_out": torch.empty(T, 64, dtype=torch.bfloat16), "norm_out": torch.empty(T, 64, dtype=torch.bfloat16)}
    systems.torch_epilogue(partial, x, out)
    res = partial.double() + x.residual.double()
    norm = res / torch.sqrt(res.square().mean(-1, keepdim=True) + config.EPS) * x.norm_weight.double()
    assert inputs.rel_err(out["residual_out"], res.float()) < 4 * ref.UNIT_ROUNDOFF[torch.bfloat16]
    assert inputs.rel_err(out["norm_out"], norm.float()) < 4 * ref.UNIT_ROUNDOFF[torch.bfloat16]
    # the check that voids a leg does see a wrong result
    assert inputs.rel_err(torch.zeros_like(out["norm_out"]), norm.float()) > config.TOLERANCE_U * \
        ref.UNIT_ROUNDOFF[torch.bfloat16]


def test_inputs_share_routing_across_ranks_but_not_partials():
    shape = config.Shape(32, 2, True)
    a = inputs.make_input_sets(shape, 3, 2, torch.bfloat16, rank=0, seed=9, device="cpu")
    b = inputs.make_input_sets(shape, 3, 2, torch.bfloat16, rank=1, seed=9, device="cpu")
    for x, y in zip(a, b):
        assert torch.equal(x.idx, y.idx) and torch.equal(x.scale, y.scale)
        assert torch.equal(x.residual, y.residual) and torch.equal(x.norm_weight, y.norm_weight)
        assert not torch.equal(x.allreduce_in, y.allreduce_in)
        assert sorted(x.idx.reshape(-1).tolist()) == list(range(6))  # every row used once, none dropped
    assert not torch.equal(a[0].residual, a[1].residual)  # the rotated sets differ


def test_contract_outputs_are_the_references_on_one_rank(tmp_path):
    """The bench's float64 check values (gloo, world size 1) are moe_ar_tools.reference's."""
    import torch.distributed as dist
    shape = config.Shape(64, 4, True)
    x = inputs.make_input_sets(shape, 5, 1, torch.bfloat16, rank=0, seed=4, device="cpu")[0]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        residual, norm = inputs.contract_outputs(x, torch.bfloat16, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    want = ref.reference([dict(allreduce_in=x.allreduce_in, expanded_idx_to_permuted_idx=x.idx,
                               expert_scale_factor=x.scale, shared_expert_output=x.shared, residual_in=x.residual,
                               norm_weight=x.norm_weight)], config.EPS, 0, config.ROUTED_SCALING_FACTOR, torch.bfloat16)
    assert torch.equal(residual, want["residual_out"].float())
    assert torch.equal(norm, want["norm_out_f64"].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared", [True, False])
def test_compiled_baseline_is_the_eager_math(dtype, shared):
    """The +compiled baselines run finalize_into / epilogue_into under torch.compile; traced by
    dynamo and AOT autograd (backend aot_eager: no C++ compiler needed) they give the eager result
    bit for bit, writing into a view of a larger buffer (the symmetric-memory case) and nothing
    outside it."""
    T, H = 5, 64
    shape = config.Shape(H, 4, shared)
    x = inputs.make_input_sets(shape, T, 1, dtype, rank=0, seed=11, device="cpu")[0]
    fin, epi = systems.compiled_fns(backend="aot_eager")
    want = torch.empty(T, H, dtype=dtype)
    systems.torch_finalize(x, want)
    big = torch.full((T + 3, H), float("nan"), dtype=dtype)
    systems.torch_finalize(x, big[:T], fin)
    assert torch.equal(big[:T].view(torch.int16), want.view(torch.int16))
    assert torch.isnan(big[T:]).all()

    def outs():
        return {k: torch.full((T, H), float("nan"), dtype=dtype) for k in ("residual_out", "norm_out")}
    eager, compiled = outs(), outs()
    systems.torch_epilogue(want, x, eager)
    systems.torch_epilogue(want, x, compiled, epi)
    for k in eager:
        assert torch.equal(compiled[k].view(torch.int16), eager[k].view(torch.int16)), k


# ---- the output check ------------------------------------------------------------------------------

def _one_rank_outputs(tmp_path, profile, seed, n_sets=2, T=5, H=256):
    """A one-rank PointRunner with its check's state only (the cross-rank gather: this rank's tensor),
    the torch baseline's outputs of `n_sets` input sets (quantized by the reference's rules) and their
    float64 check values (contract_outputs over gloo, world size 1)."""
    import torch.distributed as dist
    runner = object.__new__(point.PointRunner)
    runner.dtype, runner.W = torch.bfloat16, 1
    runner.all_gather = lambda t: t.unsqueeze(0)
    sets = inputs.make_input_sets(config.Shape(H, 4, True), T, n_sets, torch.bfloat16, rank=0, seed=seed, device="cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        refs = [inputs.contract_outputs(x, torch.bfloat16, dist.group.WORLD) for x in sets]
    finally:
        dist.destroy_process_group()
    amax = max(float(norm.abs().max()) for _, norm in refs)
    gs_value = ref.f32(ref.E4M3_MAX * 6.0 / amax)
    runner.fp8_scale_value = ref.f32(amax / ref.E4M3_MAX)
    outputs = []
    for x in sets:
        partial = torch.empty(T, H, dtype=torch.bfloat16)
        systems.torch_finalize(x, partial)
        outs = {"residual_out": torch.empty_like(partial), "norm_out": torch.empty_like(partial)}
        systems.torch_epilogue(partial, x, outs)
        if profile == "nvfp4":
            outs["quant_out"], outs["scale_out"] = ref.nvfp4_ref(outs["norm_out"], torch.tensor([gs_value]))
        elif profile == "fp8_group128":
            outs["quant_out"], outs["scale_out"] = ref.fp8_group_ref(outs["norm_out"])
        elif profile == "fp8_tensor":
            outs["quant_out"] = ref.fp8_tensor_ref(outs["norm_out"], runner.fp8_scale_value)
        outputs.append(outs)
    return runner, outputs, refs, gs_value


@pytest.mark.parametrize("profile", list(config.PROFILES))
def test_check_refuses_an_output_left_poisoned(tmp_path, profile, seed_for):
    """A NaN error (an unwritten output, still poisoned) fails its check, whichever input set it is in
    and whatever the other sets' errors are: max(0.0, nan) is 0.0 and must not hide it."""
    runner, outputs, refs, gs_value = _one_rank_outputs(tmp_path, profile, seed_for("inputs"))
    quant = config.PROFILES[profile]

    def reasons(outs):
        return runner.check(systems.System("nccl+torch", "two_shot", None, outs), refs, gs_value, quant)["reasons"]
    assert reasons(outputs) == []
    dequant = "nvfp4 dequant" if quant == "nvfp4" else "fp8 dequant"
    names = {"residual_out": ["residual_out"], "norm_out": ["norm_out"] + ([dequant] if quant else []),
             "quant_out": [dequant], "scale_out": [dequant]}
    for name in outputs[0]:
        for poisoned_set in range(len(outputs)):
            outs = [{k: v.clone() for k, v in o.items()} for o in outputs]
            poison([{name: outs[poisoned_set][name]}])
            got = reasons(outs)
            assert [why.split(" rel err")[0] for why in got] == names[name], (name, poisoned_set, got)
