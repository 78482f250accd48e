"""World size 1 without a GPU: the program space (the local family, its holes, names, selection,
tables), the NVRTC compile of the local programs (marker compile), LocalWorkspace's argument checks
and the float64 reference's world-size-1 rule (the partial is not rounded before the residual add)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from generator import abi, spec, tuning
from generator.enumeration import enumerate_programs
from moe_ar_tools import reference as ref

ROOT = pathlib.Path(__file__).resolve().parent.parent
BF16 = torch.bfloat16


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "generator.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)


# ---- the program space ------------------------------------------------------------------------------

LOCAL_FAMILIES = ("local", "local_streaming")  # the latency layout, then the streaming one


def test_world_size_one_has_the_local_programs_per_dtype_and_profile():
    enumeration = enumerate_programs()
    at_one = [p for p in enumeration.programs if p.world_size == 1]
    assert sorted(at_one) == sorted(spec.ProgramSpec(f, d, 1, p) for f in LOCAL_FAMILIES for d in spec.DTYPES
                                    for p in spec.OUTPUT_PROFILES)
    assert not [p for p in enumeration.programs if p.family in LOCAL_FAMILIES and p.world_size != 1]
    for program in at_one:
        assert spec.parse(program.name) == program
        assert program.name == f"moe_ar_{program.family}_{program.dtype}_ws1_{program.profile}"
        assert program.protocol_class == f"local_{program.dtype}_ws1"
    assert spec.parse("moe_ar_local_bf16_ws1_fp8_group128") == spec.ProgramSpec("local", "bf16", 1, "fp8_group128")
    assert spec.parse("moe_ar_local_streaming_bf16_ws1_plain") == spec.ProgramSpec("local_streaming", "bf16", 1, "plain")


def test_no_hole_across_the_world_size_one_line():
    """World size 1 and the exchange world sizes are two spaces: the local families have every cell of
    world size 1 and none elsewhere, the exchange families none at world size 1; no hole stands across
    the line (the local programs serving every exchange rung at world size 1 is selection.no_peers)."""
    enumeration = enumerate_programs()
    for hole in enumeration.holes:
        assert spec.exchanges(hole.spec.family) == (hole.spec.world_size != 1), hole
    assert {p for p in enumeration.programs if p.world_size == 1} == {
        spec.ProgramSpec(f, d, 1, p) for f in LOCAL_FAMILIES for d in spec.DTYPES for p in spec.OUTPUT_PROFILES}
    assert all(spec.exchanges(p.family) for p in enumeration.programs if p.world_size != 1)


def test_the_ladder_starts_with_the_local_rungs_and_they_serve_world_size_one_only():
    assert [r.name for r in spec.LADDER[:2]] == list(LOCAL_FAMILIES) and not any(r.exchange for r in spec.LADDER[:2])
    assert all(r.exchange for r in spec.LADDER[2:])
    assert spec.BOUNDARY_FIELDS[:2] == ("local_max_tokens", "streaming_max_tokens")
    for world_size in spec.WORLD_SIZES:
        cell = tuning.model(world_size)
        fields = cell.by_field()
        if world_size == 1:
            assert (fields["local_max_tokens"], fields["streaming_max_tokens"]) == (tuning.MODEL_LOCAL_MAX_TOKENS,
                                                                                    tuning.ALL_TOKENS)
        else:
            assert (fields["local_max_tokens"], fields["streaming_max_tokens"]) == (0, 0)
        for T in (1, 2, 7, 64, 256, 257, 300, 2048, 10 ** 6):
            want = (("local" if T <= tuning.MODEL_LOCAL_MAX_TOKENS else "local_streaming") if world_size == 1
                    else None)
            assert (cell.family(T) if cell.family(T) in LOCAL_FAMILIES else None) == want, (world_size, T)


def test_the_manifest_and_tables_carry_world_size_one():
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    assert manifest["axes"]["world_sizes"] == list(spec.WORLD_SIZES) and 1 in manifest["axes"]["world_sizes"]
    assert manifest["selection"]["ladder"][:2] == [["local", "local_max_tokens"],
                                                   ["local_streaming", "streaming_max_tokens"]]
    assert manifest["selection"]["no_peers"] == {"world_size": 1, "family": "local"}
    local = next(f for f in manifest["axes"]["families"] if f["name"] == "local")
    assert (local["base"], local["protocol"], local["regime"]) == ("local", "local", "local")
    streaming = next(f for f in manifest["axes"]["families"] if f["name"] == "local_streaming")
    assert (streaming["base"], streaming["protocol"]) == ("local", "local")
    program = (ROOT / "generated" / "programs" / "moe_ar_local_bf16_ws1_nvfp4.cu").read_text()
    assert ("moe_ar::run<__nv_bfloat16, 1, moe_ar::Profile::kNvfp4, moe_ar::Regime::kLocal, /*shared_prefetch=*/false, "
            "/*routes_in_flight=*/4, /*shared_row_first=*/true>(p);") in program
    # uncapped (spec.REGISTER_CAP): the one-block kernel's bound is the build's (one block a
    # multiprocessor at least at small rows, MAX_THREADS only otherwise), the cluster kernel's one block
    assert "void MOE_AR_ONE_BLOCK_BOUND moe_ar_local_bf16_ws1_nvfp4(" in program
    assert (f"#ifdef MOE_AR_FIXED_MIN_BLOCKS\n#define MOE_AR_ONE_BLOCK_BOUND __launch_bounds__({abi.MAX_THREADS}, "
            f"MOE_AR_FIXED_MIN_BLOCKS)\n#else\n#define MOE_AR_ONE_BLOCK_BOUND __launch_bounds__({abi.MAX_THREADS})\n"
            "#endif\n") in program
    assert f"__launch_bounds__({abi.MAX_THREADS}, 1) moe_ar_local_bf16_ws1_nvfp4_cluster(" in program
    # the streaming program: two blocks a multiprocessor, register loads, for every profile
    for profile in spec.OUTPUT_PROFILES:
        name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
        program = (ROOT / "generated" / "programs" / f"{name}.cu").read_text()
        assert "moe_ar::Regime::kLocalStreaming" in program and "row_stages" not in program
        assert f"/*routes_in_flight=*/{spec.LOCAL_BATCH_ROUTES}, /*shared_row_first=*/false>(p);" in program
        # the cap a few-routes build names (spec.STREAMING_CAP_DEFINE), else two blocks a multiprocessor
        assert f"void MOE_AR_STREAMING_BOUND {name}(" in program
        assert (f"#ifdef {spec.STREAMING_CAP_DEFINE}\n#define MOE_AR_STREAMING_BOUND __maxnreg__("
                f"{spec.STREAMING_CAP_DEFINE})\n#else\n#define MOE_AR_STREAMING_BOUND __maxnreg__("
                f"{spec.LOCAL_TWO_BLOCKS_CAP})\n#endif\n") in program
        entry = next(e for e in manifest["programs"] if e["name"] == name)
        assert entry["row_stages"] == 0


def test_gen_programs_list_and_tables_at_world_size_one():
    r = run_cli("list", "--world-size", "1")
    assert r.returncode == 0, r.stderr
    names = [row.split()[0] for row in r.stdout.splitlines()[1:]]
    assert sorted(names) == sorted(f"moe_ar_{f}_{d}_ws1_{p}" for f in LOCAL_FAMILIES
                                   for d in spec.DTYPES for p in spec.OUTPUT_PROFILES)
    assert all(" local_bf16_ws1 " in row or " local_fp16_ws1 " in row for row in r.stdout.splitlines()[1:])
    r = run_cli("list", "--family", "twoshot", "--world-size", "1")
    assert r.returncode == 1 and ("twoshot has no program at world size 1: its world sizes are 2/4/8/16; with no "
                                  "peers every exchange rung runs local there") in r.stderr, r.stderr
    r = run_cli("tables")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^  local +local, world size 1$", r.stdout, re.M), r.stdout
    assert re.search(r"^  local_streaming +local, world size 1, streaming$", r.stdout, re.M), r.stdout
    assert re.search(r"fp16 ws1 +256 / all \(model\)", r.stdout), r.stdout


@pytest.mark.compile
def test_the_local_programs_compile_within_their_budgets():
    """NVRTC for sm_90a and sm_100a: every world-size-1 program compiles without a spill; the streaming
    one within its register cap (two blocks a multiprocessor)."""
    r = run_cli("compile", "--world-size", "1")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("moe_ar_local")]
    assert len(rows) == 2 * len(LOCAL_FAMILIES) * len(spec.DTYPES) * len(spec.OUTPUT_PROFILES), r.stdout
    for name, arch, registers, spill_st, spill_ld, stack, _bytes, _seconds, *status in rows:
        assert (spill_st, spill_ld, stack, status) == ("0", "0", "0", ["ok"]), (name, arch, r.stdout)
        if spec.parse(name).family == "local":
            assert int(registers) <= 128, (name, arch, registers)
        else:
            assert int(registers) <= spec.LOCAL_TWO_BLOCKS_CAP, (name, arch, registers)


# ---- LocalWorkspace without a GPU --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=8.0), "max_tokens"),
    (dict(max_tokens=2 ** 24 + 1), "max_tokens"),
    (dict(hidden=15), "hidden"), (dict(hidden=2056 + 4), "hidden"), (dict(hidden=16384 + 16), "hidden"),
    (dict(hidden="4096"), "hidden"),
    (dict(dtype=torch.float32), "dtype"), (dict(dtype="bf16"), "dtype"),
    (dict(vec_per_thread=0), "vec_per_thread"), (dict(vec_per_thread=5), "vec_per_thread"),
    (dict(vec_per_thread=True), "vec_per_thread"),
    (dict(device="cpu"), "device"), (dict(device="nonsense"), "device"), (dict(device=1.0), "device"),
    (dict(device=True), "device"), (dict(device=10 ** 6), "device"), (dict(device="cuda:999"), "device"),
])
def test_local_workspace_names_a_bad_argument_before_allocating(kwargs, name):
    import dispatch
    from dispatch import workspace
    before = set(map(id, workspace._live_workspaces))
    args = dict(max_tokens=64, hidden=4096, dtype=BF16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{name}: "):
        dispatch.LocalWorkspace(**args)
    assert set(map(id, workspace._live_workspaces)) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the current device exists")
def test_local_workspace_on_the_current_device_needs_a_gpu():
    import dispatch
    with pytest.raises(ValueError, match="^device: None .* no CUDA device is visible"):
        dispatch.LocalWorkspace(max_tokens=64, hidden=4096, dtype=BF16)


def test_world_size_one_keeps_no_buffers_and_splits_rows_as_the_others():
    from dispatch import workspace
    assert workspace.buffer_elems_for(1, 2 ** 24, 16384, 2 ** 24) == 0
    workspace.check_sizes(1, 2 ** 24, 16384, 0)  # the largest sizes hold: nothing is exchanged
    for hidden in (7168, 384, 16384):
        one, two = workspace.WorkspaceBase(), workspace.WorkspaceBase()
        one._init_common(world_size=1, rank=0, max_tokens=2 ** 24, hidden=hidden, dtype=BF16, device_index=0,
                         timeout_s=0, oneshot_max_tokens=None, ranks_on_device=1)
        two._init_common(world_size=2, rank=0, max_tokens=1024, hidden=hidden, dtype=BF16, device_index=0,
                         timeout_s=0, oneshot_max_tokens=None, ranks_on_device=1)
        assert (one.world_size, one.rank, one.oneshot_max_tokens, one.buffer_elems, one.timeout_ns) == (1, 0, 0, 0, 0)
        assert [s[1:] for s in one.row_splits] == [s[1:] for s in two.row_splits], hidden  # threads, vectors a thread


def test_the_latency_layout_keeps_the_few_tokens_split_at_every_token_count():
    """World size 1's `local` program runs the few-tokens row split (2 vectors a thread, its all-loads
    path) at every T where that split fits a block, its warps rounded up to whole clusters of 8 where
    the row takes the cluster layout (H 7168: 512 threads, not 448); the streaming program the wide
    split at every T (two blocks a multiprocessor); every exchange follows T; a split fixed by
    vec_per_thread is every program's."""
    from dispatch import workspace
    from dispatch.workspace_sizes import ALL_TOKENS, cluster_row_split
    from dispatch import registry
    limits = registry.program_set().limits
    for hidden in (7168, 4096, 384, 16384):
        ws = workspace.WorkspaceBase()
        ws._init_common(world_size=1, rank=0, max_tokens=2 ** 20, hidden=hidden, dtype=BF16, device_index=0,
                        timeout_s=0, oneshot_max_tokens=None, ranks_on_device=1)
        local = ws.row_splits_for("local")
        assert ws.row_splits_for("local_streaming") == ws.row_splits[-1:]
        if len(ws.row_splits) == 2:  # the few-tokens split fits a block
            few = cluster_row_split(ws.row_splits[0], hidden // 8, limits["cluster_round_min_warps"],
                                    limits["cluster_max_blocks"], limits["max_threads"])
            assert local == (few._replace(max_tokens=ALL_TOKENS),), hidden
            assert local[0].vec_per_thread <= limits["few_tokens_vec_per_thread"]
            assert local[0].threads == {7168: 512, 4096: 256}.get(hidden, local[0].threads), hidden
        else:
            assert local == ws.row_splits, hidden
        fixed = workspace.WorkspaceBase()
        fixed._init_common(world_size=1, rank=0, max_tokens=64, hidden=hidden, dtype=BF16, device_index=0,
                           timeout_s=0, oneshot_max_tokens=None, ranks_on_device=1, vec_per_thread=4)
        assert fixed.row_splits_for("local") == fixed.row_splits
    two = workspace.WorkspaceBase()
    two._init_common(world_size=2, rank=0, max_tokens=1024, hidden=7168, dtype=BF16, device_index=0, timeout_s=0,
                     oneshot_max_tokens=None, ranks_on_device=1)
    assert all(two.row_splits_for(regime) == two.row_splits for regime in ("oneshot", "twoshot", "twoshot_pipelined"))


@pytest.mark.parametrize("bad,says", [("cpu", "is not a CUDA device"), ("gpu:0", "is not a device"),
                                      (True, "is not a GPU index"), (1.0, "is not a GPU index"),
                                      (10 ** 6, "does not exist")])
def test_a_bad_device_is_named_as_the_argument_it_came_in(bad, says):
    """One parser for a LocalWorkspace's `device` and an EmulatedWorld's `devices` entries."""
    from dispatch.local import device_index_of
    from dispatch.workspace_arguments import check_devices
    with pytest.raises(ValueError, match=f"^device: .*{says}"):
        device_index_of(bad)
    with pytest.raises(ValueError, match=f"^devices: .*{says}"):
        check_devices(["cuda", bad], 2)
    assert check_devices(["cuda", "cuda"], 2) == [None, None]  # the current device, resolved later


def test_emulated_world_of_one_rank_is_refused_naming_world_size():
    import dispatch
    with pytest.raises(ValueError, match=r"^world_size: 1 has no peers to emulate; use dispatch.LocalWorkspace"):
        dispatch.EmulatedWorld(1, 64, 4096, BF16)


# ---- the reference at world size 1 -------------------------------------------------------------------

def _one_token(rows, residual, dtype=BF16, weights=None, shared=None, rsf=1.0):
    """One token of one rank: routes over the given rows (route k reads row k)."""
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)[:, None].repeat(1, 16)
    return dict(allreduce_in=x, expanded_idx_to_permuted_idx=torch.arange(len(rows), dtype=torch.int32)[None],
                expert_scale_factor=None if weights is None else torch.tensor([weights], dtype=torch.float32),
                shared_expert_output=None if shared is None else torch.full((1, 16), shared, dtype=dtype),
                residual_in=torch.full((1, 16), residual, dtype=torch.float64).to(dtype),
                norm_weight=torch.ones(16, dtype=dtype), routed_scaling_factor=rsf, eps=1e-6, weight_bias=0)


def test_reference_at_world_size_one_does_not_round_the_partial():
    """docs/operation.md's example: rows 1 and 2^-8, residual 2^-8, bf16. Exact (and world size 1):
    1 + 2^-7; the partial rounded first (what a world-size-2 call whose other rank sends zeros
    computes): 1 + 2^-8 ties to 1.0, then 1.0 + 2^-8 again: 1.0."""
    token = _one_token([1.0, 2.0 ** -8], 2.0 ** -8)
    one = ref.reference([token], 1e-6, 0, 1.0, BF16)
    assert one["residual_out"].double().unique().tolist() == [1.0 + 2.0 ** -7]
    assert one["residual_lo"].double().unique().tolist() == [1.0 + 2.0 ** -7]  # no fp32 error reaches a tie here
    assert one["residual_hi"].double().unique().tolist() == [1.0 + 2.0 ** -7]
    assert one["partials"][0].dtype == torch.float64 and one["partials"][0].unique().tolist() == [1.0 + 2.0 ** -8]
    silent = dict(token, allreduce_in=torch.zeros_like(token["allreduce_in"]),
                  residual_in=token["residual_in"].clone())
    two = ref.reference([token, silent], 1e-6, 0, 1.0, BF16)
    assert two["residual_out"].double().unique().tolist() == [1.0]
    # the norm follows the world-size-1 residual_out
    assert torch.equal(one["norm_out"], ref.round_to_dtype(ref.rmsnorm_f64(one["residual_out"],
                                                                           token["norm_weight"], 1e-6, 0), BF16))


def test_reference_at_world_size_one_with_weights_shared_and_scaling():
    """fp16, router weights, routed_scaling_factor and the shared expert: rsf * sum w x + shared =
    2.156738... is 1104.25 steps of 2^-9 (and a little more); the residual 0.1256103515625 adds
    64.3125 steps: the sum, 1168.56 steps, rounds up to 2.283203125, while the partial rounded first
    (1104 steps) plus the residual rounds down to 2.28125."""
    residual = 0.125 + 5 * 2.0 ** -13  # an fp16 value
    token = _one_token([1.5, -0.25, 3.0], residual, dtype=torch.float16, weights=[0.5, 0.75, 0.1],
                       shared=2.0 ** -11, rsf=2.5)
    w = [ref.f32(v) for v in (0.5, 0.75, 0.1)]
    partial = ref.f32(2.5) * (w[0] * 1.5 + w[1] * -0.25 + w[2] * 3.0) + 2.0 ** -11
    got = ref.reference([token], 1e-6, 0, 2.5, torch.float16)
    assert got["residual_out_f64"].unique().tolist() == pytest.approx([partial + residual], rel=1e-15)
    assert got["residual_out"].unique().tolist() == [2.283203125]
    assert 1104.25 < partial / 2.0 ** -9 < 1104.26  # rounded first: 1104 steps
    lo, hi, res = (got[k].double() for k in ("residual_lo", "residual_hi", "residual_out"))
    assert (lo == res).all() and (hi == res).all()  # the bracket leaves out the rounded-first 2.28125


def test_reference_bracket_at_world_size_one_holds_an_fp32_evaluation(seed_for):
    """An fp32 evaluation in the kernel's order (fma per route, * rsf, + shared, + residual, one
    rounding) lies in the bracket at every element; the partial rounded first does not, somewhere."""
    case = ref.make_case(1, 24, 256, 8, BF16, seed=seed_for("case"), shared=True, scale_kind="fp32", rsf=1.7,
                         drop_frac=0.2, padded_rows=3)
    kw = case[0]
    got = ref.reference_for(case)
    x, idx, w = kw["allreduce_in"].float(), kw["expanded_idx_to_permuted_idx"].long(), kw["expert_scale_factor"]
    acc = torch.zeros(24, 256)
    for k in range(8):
        ok = (idx[:, k] >= 0)[:, None]
        acc = torch.where(ok, torch.addcmul(acc, w[:, k, None], x[idx[:, k].clamp(min=0)]), acc)
    partial = acc * ref.f32(1.7) + kw["shared_expert_output"].float()
    fp32 = (partial + kw["residual_in"].float()).to(BF16).double()
    assert ((got["residual_lo"].double() <= fp32) & (fp32 <= got["residual_hi"].double())).all()
    rounded_first = (partial.to(BF16).float() + kw["residual_in"].float()).to(BF16).double()
    outside = ~((got["residual_lo"].double() <= rounded_first) & (rounded_first <= got["residual_hi"].double()))
    assert outside.any(), "rounding the partial first is not told apart from the world-size-1 rule"


def test_an_exchange_rung_at_world_size_one_runs_the_latency_program():
    """With no peers every exchange rung runs `local` (the manifest's selection.no_peers), so a fitted
    world-size-1 ladder may return to the latency layout after the streaming one."""
    from dispatch import registry
    for family in ("oneshot", "twoshot_early", "twoshot", "twoshot_pipelined", "twoshot_pipelined_loads",
                   "twoshot_shared"):
        for dtype, profile in (("bf16", "plain"), ("fp16", "nvfp4")):
            assert registry.program_for(family, dtype, 1, profile) == f"moe_ar_local_{dtype}_ws1_{profile}"
    bounds = {field: 0 for field in tuning.model(1).by_field()}
    bounds.update(local_max_tokens=4, streaming_max_tokens=64, oneshot_max_tokens=tuning.ALL_TOKENS)
    for T, want in ((1, "local"), (4, "local"), (5, "local_streaming"), (64, "local_streaming"), (65, "local"),
                    (10 ** 6, "local")):
        for capacity in (0, 10 ** 6):  # a world of one has no one-shot buffer: the rungs after it fall back alike
            family = registry.select_family("bf16", 1, "plain", T, True, capacity, bounds=bounds)
            assert registry.program_for(family, "bf16", 1, "plain") == f"moe_ar_{want}_bf16_ws1_plain", (T, capacity)
    # across the line the other way there is still nothing: a world-size-1 family at world size 2
    with pytest.raises(ValueError, match="no program"):
        registry.program_for("local", "bf16", 2, "plain")
