"""moe_ar_tools/soak/ without a GPU: argument parsing, the token sampler, the soak's cheap per-call
check (the reference's residual_expectation, norm_expectation and nvfp4_blocks) against the float64
reference, and the whole soak loop against a stand-in world whose "kernel" is the float64 reference
(every call's arguments pass the runtime's own checks first)."""
from __future__ import annotations

import json
import math
import random
import types

import pytest
import torch

from moe_ar_tools import reference as ref
from dispatch import op
from dispatch.call_arguments import CALL_DEFAULTS, check_call_arguments
from moe_ar_tools.soak import cli, result, runner, sampling

# ---- arguments ------------------------------------------------------------------------------------


def test_parse_args_defaults_and_devices():
    a = cli.parse_args(["--world-size", "4", "--seed", "5"])
    assert a.world_size == 4 and a.calls == 100_000 and a.device_list is None and a.seed == 5
    assert a.quant_list == [None, "nvfp4"] and a.dtype == "bf16" and a.hidden == 2048
    a = cli.parse_args(["--world-size", "4", "--devices", "0,1", "--calls", "10", "--time-budget-s", "3",
                        "--out", "x.json", "--quants", "nvfp4"])
    assert a.device_list == [0, 1, 0, 1] and a.calls == 10 and a.time_budget_s == 3.0 and a.out == "x.json"
    assert a.quant_list == ["nvfp4"] and isinstance(a.seed, int)
    assert cli.parse_args(["--world-size", "2", "--devices", "0,1"]).device_list == [0, 1]


@pytest.mark.parametrize("argv", [
    [],                                                   # --world-size is required
    ["--world-size", "1"],
    ["--world-size", "2", "--devices", "0,1,2"],          # more devices than ranks
    ["--world-size", "2", "--devices", "a,b"],
    ["--world-size", "2", "--quants", "fp4"],
    ["--world-size", "2", "--hidden", "100"],
    ["--world-size", "2", "--calls", "0"],
    ["--world-size", "2", "--graph-fraction", "1.5"],
])
def test_parse_args_rejects(argv):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2


def test_default_max_tokens_reaches_every_regime_of_the_selection_table():
    from dispatch import gpu_facts, registry, table_sets
    h200 = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink")
    for device in (h200, gpu_facts.UNKNOWN_DEVICE):
        for dname in ("bf16", "fp16"):
            for W in (2, 4, 8):
                for hidden in (2048, 7168):
                    selection = table_sets.resolve(dtype=dname, world_size=W, hidden=hidden, elem_bytes=2,
                                                   device=device, user=None, program_set_sha256="")
                    rows = [selection.limits(p) for p in selection.cells]
                    m = sampling.default_max_tokens(rows)
                    assert m >= 2048 and m % 128 == 0
                    for s in rows:
                        for value in s.values():
                            assert m > value or value == registry.program_set().all_tokens, (dname, W, s)


# ---- token counts and regimes -----------------------------------------------------------------------


def _fake_select(T, quant, shared):
    one = 256 if quant is None else 1024
    if T <= one:
        return "oneshot"
    if T <= 1500:
        return "twoshot_early_shared" if shared else "twoshot_early"
    return "twoshot_shared" if shared else "twoshot"


def test_regime_boundaries_finds_every_change():
    b = sampling.regime_boundaries(_fake_select, 2048, [None, "nvfp4"])
    assert b == {None: [257, 1501], "nvfp4": [1025, 1501]}
    assert sampling.regime_ranges(b[None], 2048) == [(1, 256), (257, 1500), (1501, 2048)]


@pytest.mark.parametrize("W", [2, 4, 8])
def test_sampler_covers_every_regime_and_both_sides_of_every_boundary(W):
    max_tokens = 2304
    bounds = {None: [17, 2049], "nvfp4": [17, 1025, 2049]}
    s = sampling.TokenSampler(max_tokens, bounds, W, random.Random(3))
    for q, bs in bounds.items():
        seen = [s.draw(q) for _ in range(6000)]
        assert min(seen) >= 1 and max(seen) <= max_tokens
        assert 1 in seen and max_tokens in seen and W in seen
        for lo, hi in sampling.regime_ranges(bs, max_tokens):
            assert sum(lo <= t <= hi for t in seen) >= 30, (q, lo, hi)
        for b in bs:
            assert b - 1 in seen and b in seen, (q, b)
        # log-uniform part: small token counts are common, not 1 in 2000
        assert sum(t <= 16 for t in seen) > 0.15 * len(seen)
        # consecutive draws cross each boundary both ways
        for b in bs:
            up = sum(a < b <= c for a, c in zip(seen, seen[1:]))
            down = sum(c < b <= a for a, c in zip(seen, seen[1:]))
            assert up > 20 and down > 20, (q, b, up, down)


def test_graph_token_counts_cover_each_regime():
    rnd = random.Random(1)
    Ts = sampling.graph_token_counts([257, 1501], 2048, rnd)
    for lo, hi in [(1, 256), (257, 1500), (1501, 2048)]:
        assert lo in Ts and hi in Ts and sum(lo <= t <= hi for t in Ts) >= 2


def test_draw_config_keeps_rows_within_the_buffers():
    rnd = random.Random(0)
    for T in (1, 7, 100, 2048):
        for _ in range(200):
            c = sampling.draw_config(rnd, "nvfp4", T, 2048 * 8 + 16)
            assert 1 <= c.top_k <= 16 and c.tokens * c.top_k + c.padded_rows <= 2048 * 8 + 16
            assert c.scale in ("none", "fp32", "dtype") and c.shared in ("none", "all", "rank0")
            assert c.gs_range in sampling.GS_LOG_RANGES and c.rsf == ref.f32(c.rsf)
    hash(c)  # graph cache key


# ---- the cheap reference against the float64 reference ----------------------------------------------


def _stacked(case):
    """The soak's layout of a reference Case: X [W, R + 1, H] with a zero row R for dropped routes."""
    W = len(case)
    idx = case[0]["expanded_idx_to_permuted_idx"]
    T, K = idx.shape
    R, H = case[0]["allreduce_in"].shape
    dtype = case.meta["dtype"]
    X = torch.zeros(W, R + 1, H, dtype=dtype)
    for r, kw in enumerate(case):
        X[r, :R] = kw["allreduce_in"]
    ridx = torch.where(idx < 0, torch.full_like(idx, R), idx).long().reshape(-1)
    scale = case[0]["expert_scale_factor"]
    shared = None
    if any(kw["shared_expert_output"] is not None for kw in case):
        shared = torch.stack([kw["shared_expert_output"] if kw["shared_expert_output"] is not None
                              else torch.zeros(T, H, dtype=dtype) for kw in case])
    return X, ridx, T, K, (None if scale is None else scale.reshape(-1)), shared


def _cases():
    rnd = random.Random(11)
    for i in range(36):
        W = (2, 4, 8)[i % 3]
        dtype = (torch.bfloat16, torch.float16)[(i // 3) % 2]
        T = rnd.choice([1, 3, 17, 40])
        K = rnd.randint(1, 8)
        yield i, ref.make_case(W, T, 128, K, dtype, seed=1000 + i, scale_kind=(None, "fp32", "dtype")[i % 3],
                               shared=i % 4 != 0, rsf=1.0 if i % 2 else ref.f32(rnd.uniform(0.3, 2.5)),
                               weight_bias=(i // 2) % 2, padded_rows=rnd.choice([0, 5]),
                               drop_frac=rnd.choice([0.0, 0.2]))


def _cancelling_case(seed, W=4, dtype=torch.bfloat16):
    """Ranks whose partials nearly cancel, residual tiny: the tolerance is tested where it is tightest
    relative to the magnitudes."""
    case = ref.make_case(W, 9, 64, 4, dtype, seed=seed, scale_kind="fp32", shared=True, drop_frac=0.0)
    g = torch.Generator().manual_seed(seed)
    base = case[0]["allreduce_in"].float()
    for r, kw in enumerate(case):
        sign = 1.0 if r % 2 == 0 else -1.0
        kw["allreduce_in"] = (sign * base * (1 + 1e-3 * torch.randn(base.shape, generator=g))).to(dtype)
        kw["shared_expert_output"] = (sign * 3 * torch.randn(9, 64, generator=g)).to(dtype) if r < 2 else \
            (-sign * 3 * torch.randn(9, 64, generator=g)).to(dtype)
    for kw in case:
        kw["residual_in"] = (torch.randn(9, 64, generator=torch.Generator().manual_seed(seed + 1)) * 1e-3).to(dtype)
    return case


def _all_cases():
    yield from _cases()
    for s in range(6):
        yield f"cancel{s}", _cancelling_case(500 + s, W=(2, 4, 8)[s % 3], dtype=(torch.bfloat16, torch.float16)[s % 2])


@pytest.mark.parametrize("i,case", list(_all_cases()), ids=lambda x: str(x) if not isinstance(x, list) else "")
def test_cheap_residual_check_accepts_the_reference_and_its_whole_bracket(i, case):
    m = case.meta
    r0 = ref.reference_for(case)
    X, ridx, T, K, scale, shared = _stacked(case)
    S, tol = ref.residual_expectation(X, ridx, T, K, scale, m["rsf"], shared, case[0]["residual_in"], m["dtype"])
    assert torch.isfinite(S).all() and (tol > 0).all()
    for name in ("residual_out", "residual_lo", "residual_hi"):
        assert int(ref.count_bad(r0[name], S, tol)) == 0, (i, name)
    # and it is tight: a result missing the last rank's partial fails nearly everywhere
    missing = ref.round_to_dtype(r0["residual_out_f64"] - r0["partials"][-1].double(), m["dtype"])
    changed = missing != r0["residual_out"]
    assert int(ref.count_bad(missing, S, tol)) >= 0.9 * int(changed.sum()), i
    # NaN (an unwritten element) is wrong
    bad = r0["residual_out"].clone()
    bad[0, 0] = math.nan
    assert int(ref.count_bad(bad, S, tol)) == 1


def test_cheap_residual_check_rejects_a_few_ulps():
    case = ref.make_case(2, 32, 256, 4, torch.bfloat16, seed=3, scale_kind="fp32", shared=True)
    m = case.meta
    r0 = ref.reference_for(case)
    X, ridx, T, K, scale, shared = _stacked(case)
    S, tol = ref.residual_expectation(X, ridx, T, K, scale, m["rsf"], shared, case[0]["residual_in"], m["dtype"])
    off = r0["residual_out"].double() + 4 * ref.ulp(r0["residual_out"], m["dtype"])
    assert int(ref.count_bad(off, S, tol)) > 0.5 * off.numel()


@pytest.mark.parametrize("i,case", list(_cases())[:12], ids=str)
def test_cheap_norm_check_accepts_the_reference_and_its_bracket(i, case):
    m = case.meta
    r0 = ref.reference_for(case)
    gamma_w = case[0]["norm_weight"]
    y, tol = ref.norm_expectation(r0["residual_out"], gamma_w, m["eps"], m["weight_bias"], m["dtype"])
    assert int(ref.count_bad(r0["norm_out"], y, tol)) == 0
    _, lo, hi = ref.norm_bracket(r0["residual_out"], gamma_w, m["eps"], m["weight_bias"], m["dtype"])
    assert int(ref.count_bad(lo, y, tol)) == 0 and int(ref.count_bad(hi, y, tol)) == 0
    off = r0["norm_out"].double() + 3 * ref.ulp(r0["norm_out"], m["dtype"])
    assert int(ref.count_bad(off, y, tol)) > 0.5 * off.numel()


def _nvfp4_inputs():
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(37, 256, generator=g) * torch.rand(37, 1, generator=g) * 4).to(torch.bfloat16)
    yield "random", x, ref.typical_global_scale(x)
    yield "random gs 1", x, 1.0
    yield "random tiny gs", x, 3e-6 * ref.typical_global_scale(x)
    yield "random huge gs", x, 1e4
    # exact E2M1 ties: with block amax 6 and gs 1, the block scale is 1 and x is quantized as is
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                         -0.0], dtype=torch.float32)
    t = torch.cat([ties, -ties.flip(0), ties * 1.0001, ties * 0.9999]).reshape(4, 16)
    t[:, 7] = 6.0
    yield "ties", t.to(torch.bfloat16).repeat(3, 4), 1.0
    yield "ties fp16", t.to(torch.float16).repeat(2, 2), 1.0
    z = torch.zeros(5, 64, dtype=torch.float16)
    z[1, 3] = -0.0
    yield "zeros", z, 448.0


@pytest.mark.parametrize("what,x,gs", list(_nvfp4_inputs()), ids=lambda v: v if isinstance(v, str) else "")
def test_cheap_nvfp4_with_a_tensor_global_scale_equals_the_reference_bytes(what, x, gs):
    """The soak hands the global scale as a tensor (never read back to the host): the same bytes."""
    T, H = x.shape
    q, sf8 = ref.nvfp4_blocks(x, torch.tensor([ref.f32(gs)], dtype=torch.float32))
    qref, sref = ref.nvfp4_ref(x, ref.f32(gs))
    assert torch.equal(q, qref), what
    sb = torch.zeros(op.scale_out_bytes(T, H), dtype=torch.uint8)
    sb[ref.swizzle_offsets(T, H).reshape(-1)] = sf8.reshape(-1)
    assert torch.equal(sb, sref), what


@pytest.mark.parametrize("T,H", [(1, 16), (37, 256), (128, 2048), (300, 2064)])
def test_swizzle_offsets_of_the_first_rows_do_not_depend_on_the_rows_after(T, H):
    """The soak computes max_tokens' offsets once and uses the first T rows' for T tokens."""
    assert torch.equal(ref.swizzle_offsets(T + 200, H)[:T], ref.swizzle_offsets(T, H))


# ---- the whole loop against a stand-in world ----------------------------------------------------------


class FakeWorld:
    """EmulatedWorld's interface on the CPU: run() validates every rank's kwargs with the runtime's own
    checks, then writes the float64 reference (a legal kernel result) into the given outputs.
    corrupt: {call number: fn(per_rank_kwargs)} damages outputs after a call."""

    def __init__(self, W, max_tokens, hidden, dtype, oneshot_max_tokens=16, corrupt=None):
        from dispatch import gpu_facts, table_sets
        selection = table_sets.resolve(dtype=ref.dtype_name(dtype), world_size=W, hidden=hidden, elem_bytes=2,
                                       device=gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink"), user=None,
                                       program_set_sha256="")
        self.workspaces = [types.SimpleNamespace(
            rank=r, world_size=W, max_tokens=max_tokens, hidden=hidden, dtype=dtype, dtype_name=ref.dtype_name(dtype),
            device=torch.device("cpu"), oneshot_max_tokens=oneshot_max_tokens, selection=selection) for r in range(W)]
        self.devices = ["cpu"] * W
        self.dtype = dtype
        self.calls = 0
        self.corrupt = corrupt or {}
        self.checks = 0
        self.closed = False

    def run(self, per_rank):
        assert len(per_rank) == len(self.workspaces)
        required = {"allreduce_in", "expanded_idx_to_permuted_idx", "residual_in", "norm_weight"}
        for ws, kw in zip(self.workspaces, per_rank):
            unknown = set(kw) - set(CALL_DEFAULTS) - required
            assert not unknown, unknown
            a = dict(CALL_DEFAULTS)
            a.update(kw)
            check_call_arguments(ws, a)
        kw0 = per_rank[0]
        r = ref.reference(per_rank, kw0["eps"], kw0["weight_bias"], kw0["routed_scaling_factor"], self.dtype)
        quant = kw0.get("quant")
        if quant == "nvfp4":
            q, sb = ref.nvfp4_ref(r["norm_out"], kw0["global_scale"])
        for kw in per_rank:
            kw["residual_out"].copy_(r["residual_out"])
            kw["norm_out"].copy_(r["norm_out"])
            if quant == "nvfp4":
                kw["quant_out"].copy_(q)
                kw["scale_out"][: sb.numel()].copy_(sb)
        if self.calls in self.corrupt:
            self.corrupt[self.calls](per_rank)
        self.calls += 1

    def check(self):
        self.checks += 1

    def reset(self):
        pass

    def close(self):
        self.closed = True


def _soak_args(W, calls, extra=()):
    return cli.parse_args(["--world-size", str(W), "--calls", str(calls), "--hidden", "64", "--max-tokens", "40",
                           "--full-check-every", "25", "--check-every", "50", "--no-progress", "--seed", "7",
                           *extra])


@pytest.mark.parametrize("W", [2, 4])
def test_soak_loop_with_a_correct_world_passes(W, tmp_path):
    world = FakeWorld(W, 40, 64, torch.bfloat16)
    s = runner.Soak(_soak_args(W, 150), world=world)
    assert s.max_tokens == 40 and s.graph_note.startswith("eager calls only")
    r = s.run()
    assert r["passed"], json.dumps(r["failures"], indent=1)[:3000]
    assert r["calls"] == 150 == world.calls and r["eager_calls"] == 150 and r["graph_calls"] == 0
    assert r["wrong_elements"] == 0 and r["timeouts"] == 0 and r["hangs"] == 0 and r["error"] is None
    assert r["full_checks"] == 6 and r["full_check_failures"] == 0
    assert world.checks == 4  # every 50 calls and at the end
    assert set(r["regimes"]) == {"oneshot", "twoshot_early"} or set(r["regimes"]) >= {"oneshot"}
    assert len(r["regimes"]) >= 2, r["regimes"]
    assert r["quant_calls"].keys() == {"none", "nvfp4"} and 0 < r["pdl_calls"] < 150
    assert r["tokens"]["min"] == 1 and r["tokens"]["max"] == 40
    assert all(c["up"] and c["down"] for c in r["boundary_crossings"].values()), r["boundary_crossings"]
    assert world.closed is False  # a world given to Soak is the caller's
    result.write_result(r, tmp_path / "out" / "soak.json")
    back = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert back["calls"] == 150 and back["commit"] and back["machine"]["gpus"] == 0
    assert "PASS" in result.summary_line(back)


def _add_one(name, rank, where=(0, 0)):
    def damage(kws):
        t = kws[rank][name]
        if t.dtype == torch.uint8:
            t[where] ^= 0x01
        else:
            t[where] = (t[where].float() * 1.0625 + 0.5).to(t.dtype)
    return damage


@pytest.mark.parametrize("what,damage", [
    ("residual_out of rank 0", _add_one("residual_out", 0)),
    ("norm_out of rank 0", _add_one("norm_out", 0, (1, 3))),
    ("residual_out of the last rank only", _add_one("residual_out", -1)),
    ("an unwritten element", lambda kws: kws[0]["norm_out"].view(-1)[-1].fill_(math.nan)),
])
def test_soak_loop_counts_a_wrong_element_and_checks_that_call_in_full(what, damage):
    world = FakeWorld(2, 40, 64, torch.bfloat16, corrupt={37: damage})
    r = runner.Soak(_soak_args(2, 60), world=world).run()
    assert not r["passed"] and r["wrong_calls"] >= 1 and r["wrong_elements"] >= 1, what
    assert r["failures"][0]["call"] == 37, r["failures"]
    assert r["full_check_failures"] >= 1, what  # the failing call got a full reference check, which failed too
    assert any(f.get("full_check") and f["call"] == 37 for f in r["failures"]), r["failures"]


def test_soak_loop_checks_nvfp4_bytes_and_the_untouched_scale_tail():
    def damage_quant(kws):
        if kws[0].get("quant") == "nvfp4":
            kws[0]["quant_out"][0, 0] ^= 0x10

    def damage_tail(kws):
        if kws[1].get("quant") == "nvfp4":
            kws[1]["scale_out"][-1] = 0  # past the required length: must stay untouched
    for damage, counter in ((damage_quant, "quant_out"), (damage_tail, "scale_tail")):
        world = FakeWorld(2, 40, 64, torch.bfloat16, corrupt={i: damage for i in range(40)})
        r = runner.Soak(_soak_args(2, 40, ["--quants", "nvfp4"]), world=world).run()
        assert not r["passed"] and r["wrong_by_output"][counter] >= 1, (counter, r["wrong_by_output"])


def test_soak_loop_records_a_timeout_and_resets():
    class TimingOut(FakeWorld):
        resets = 0

        def run(self, per_rank):
            if self.calls == 12:
                self.calls += 1
                raise RuntimeError("moe_finalize_allreduce: rank 1 timed out in phase one-shot (...)")
            super().run(per_rank)

        def reset(self):
            TimingOut.resets += 1
    world = TimingOut(2, 40, 64, torch.float16)
    r = runner.Soak(_soak_args(2, 30, ["--dtype", "fp16"]), world=world).run()
    assert r["timeouts"] == 1 and TimingOut.resets == 1 and not r["passed"] and r["wrong_elements"] == 0
    assert "timed out" in r["timeout_messages"][0]


def test_soak_loop_stops_at_the_time_budget():
    world = FakeWorld(2, 40, 64, torch.bfloat16)
    r = runner.Soak(_soak_args(2, 10_000, ["--time-budget-s", "0.5"]), world=world).run()
    assert r["stopped_by"] == "time_budget" and 0 < r["calls"] < 10_000 and r["passed"]
