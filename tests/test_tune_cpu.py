"""`gen-programs tune` on the CPU, with fakes for the GPU part: the slowest rank, the loop (resume,
the time budget, progress), the refusal of emulated ranks, and an output file that the runtime takes
as a user's own set and the generator as a committed one."""
from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys

import pytest

import dispatch
from dispatch import gpu_facts
from dispatch import table_sets as runtime_sets
from dispatch.workspace import program_set_sha256
from generator import spec
from generator import table_sets as generator_sets
from moe_ar_tools.bench.config import Shape
from moe_ar_tools.tune import cli, loop, units

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAMP = {"gpu": {"product": "NVIDIA H200", "count": 2, "sm_count": 132, "capability": "9.0"},
         "interconnect": {"kind": "nvlink", "nvlink_generation": 4, "nvlink_links": 18, "peer_bandwidth_GBps": 388.0},
         "driver": "580.159.04", "cuda": "13.0", "torch": "2.13.0+cu130", "nvrtc": "13.0",
         "program_set_sha256": program_set_sha256(), "commit": "0123abc", "date": "2026-12-02T10:00:00"}
H200 = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink")
SHAPES = [Shape(7168, 8, True), Shape(4096, 8, False)]
TOKENS = [1, 64, 512, 4096]


# ---- the slowest rank ---------------------------------------------------------------------------

def test_each_replay_takes_the_slowest_ranks_time():
    per_rank = [{"p": {"replay_us": [10.0, 12.0, 11.0, 10.0, 30.0], "reasons": []}},
                {"p": {"replay_us": [11.0, 10.0, 13.0, 10.5, 9.0], "reasons": []}}]
    got = loop.combine_ranks(per_rank)["p"]
    assert got["median_us"] == 12.0  # of [11, 12, 13, 10.5, 30], not of either rank's own series
    assert got["replays"] == 5 and got["valid"] and got["reasons"] == []
    assert got["p10_us"] == pytest.approx(10.5 + 0.4 * 0.5) and got["p90_us"] == pytest.approx(13 + 0.6 * 17)
    assert got["noise_us"] == pytest.approx((got["p90_us"] - got["p10_us"]) / 2)
    # a rank whose outputs were wrong makes the point invalid, a rank without the program too
    per_rank[1]["p"]["reasons"] = ["norm_out rel err 1 > 0.03"]
    per_rank[0]["q"] = {"replay_us": [1.0], "reasons": []}
    got = loop.combine_ranks(per_rank)
    assert not got["p"]["valid"] and got["p"]["reasons"] == ["rank 1: norm_out rel err 1 > 0.03"]
    assert got["q"] == {"median_us": None, "p10_us": None, "p90_us": None, "noise_us": None, "replays": 0,
                        "valid": False, "reasons": ["rank 1: not measured"]}


# ---- the loop with a fake machine ----------------------------------------------------------------------------

def _times(unit, family: str) -> float:
    """A machine whose one-shot wins up to 4 MiB a rank and the pipelined two-shot above (world size 2)."""
    rows = unit.tokens * unit.hidden * 2
    base = 8 + rows / 400_000
    return {"oneshot": base if rows <= 4 << 20 else 3 * base, "twoshot_early": 1.3 * base, "twoshot": 1.4 * base,
            "twoshot_pipelined_loads": 1.2 * base, "twoshot_pipelined": 1.1 * base}[family]


class FakeMachine:
    """measure(unit): every rank's replay times of every base program of the unit's cell; rank 1 a
    little slower on odd replays. Counts the units it measured; `stop_after` raises then (a lost run);
    `clock` advances 10 s a unit."""

    def __init__(self, world_size=2, stop_after=None):
        self.world_size, self.stop_after, self.measured, self.now = world_size, stop_after, [], 0.0

    def clock(self):
        return self.now

    def measure(self, unit):
        if self.stop_after is not None and len(self.measured) == self.stop_after:
            raise KeyboardInterrupt
        self.measured.append(unit)
        self.now += 10.0
        names = {p for p in dispatch.programs()}
        per_rank = []
        for rank in range(self.world_size):
            mine = {}
            for family in dict.fromkeys(generator_sets.tuning.LADDER_FAMILIES):
                if unit.world_size not in spec.world_sizes_of(family):
                    continue
                name = spec.ProgramSpec(family, unit.dtype, unit.world_size, unit.profile).name
                if name in names:
                    us = _times(unit, family)
                    mine[name] = {"replay_us": [us * (1 + 0.01 * rank * (i % 2)) for i in range(20)], "reasons": []}
            per_rank.append(mine)
        return per_rank


def _plan(profiles=("plain", "nvfp4")):
    return units.plan([2], "bf16", SHAPES, TOKENS, list(profiles))


def _run(out, machine, deadline=float("inf"), plan=None, progress=None, stamp=STAMP):
    return loop.run(plan or _plan(), machine.measure, out, name="tuned here", stamp=stamp, config={"test": True},
                    deadline=deadline, clock=machine.clock, progress=progress)


def test_a_run_writes_measurements_a_stamp_and_the_fitted_set(tmp_path):
    out = tmp_path / "tables.json"
    stream = io.StringIO()
    doc = _run(out, FakeMachine(), progress=loop.Progress(stream))
    assert doc == json.loads(out.read_text()) and doc["complete"] and not doc["truncated"]
    assert len(doc["done"]) == len(_plan()) == 16 and doc["stamp"] == STAMP
    record = next(r for r in doc["measurements"] if r["program"] == "moe_ar_oneshot_bf16_ws2_plain" and r["tokens"] == 64)
    assert record["family"] == "oneshot" and record["valid"] and record["replays"] == 20
    assert record["median_us"] == pytest.approx(_times(units.Unit(2, "bf16", 7168, 8, True, 64, "plain"), "oneshot")
                                                * 1.005)  # half the replays rank 1's, 1% slower: the slowest rank
    rows = {(r["dtype"], r["world_size"], r["profile"]): r for r in doc["set"]["boundaries"]}
    assert set(rows) == {(d, 2, p) for d in spec.DTYPES for p in spec.OUTPUT_PROFILES}  # dtype and profile donors
    assert rows[("bf16", 2, "plain")]["limits"]["oneshot_max_tokens"] == 4 << 20
    assert rows[("bf16", 2, "nvfp4")]["source"].startswith("measured in tables.json: 0 of 8 points over")
    assert rows[("fp16", 2, "fp8_tensor")]["source"].startswith("measured (bf16 data, profile plain) in tables.json")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 16 and lines[0].startswith("[") and "1/16 ws2 bf16 H7168 K8 shared T=1 plain" in lines[0]
    assert lines[-1].endswith("16/16 ws2 bf16 H4096 K8 T=4096 nvfp4, 0m00s left") and "2m30s left" in lines[0]


def test_the_runtime_takes_the_output_as_a_users_own_set(tmp_path):
    out = tmp_path / "tables.json"
    _run(out, FakeMachine())
    user = runtime_sets.read_user_set(out, "tables")
    assert runtime_sets.user_set_mismatch(user, H200, program_set_sha256()) is None
    selection = runtime_sets.resolve(dtype="bf16", world_size=2, hidden=7168, elem_bytes=2, device=H200, user=user,
                                     program_set_sha256=program_set_sha256())
    assert selection.set == "tuned here" and selection.limits("plain")["oneshot_max_tokens"] == (4 << 20) // (7168 * 2)
    # ... and refuses it on another machine
    other = gpu_facts.DeviceKey("NVIDIA H100 80GB HBM3", "9.0", 132, "nvlink")
    assert "product" in runtime_sets.user_set_mismatch(user, other, program_set_sha256())


def test_the_generator_takes_the_output_as_a_committed_set(tmp_path):
    out = tmp_path / "bench_results" / "tuning" / "h200_tuned.json"
    _run(out, FakeMachine())
    rel = out.relative_to(tmp_path).as_posix()
    declared = generator_sets.Declared("h200_tuned", "tuned", {"product": "NVIDIA H200", "capability": "9.0",
                                                                 "interconnect": "nvlink"}, (rel,))
    built = generator_sets.build_set(declared, [generator_sets.read_measurements(tmp_path, rel)])
    assert built.sources[0]["stamp"] == STAMP
    assert built.boundaries[("bf16", 2, "plain")].limits[spec.BOUNDARY_FIELDS.index("oneshot_max_tokens")] == 4 << 20
    assert built.boundaries[("bf16", 4, "plain")].source == generator_sets.tuning.MODEL_SOURCE
    # the set the tune wrote is the one the generator fits from the same measurements
    doc = json.loads(out.read_text())
    rows = {(r["dtype"], r["world_size"], r["profile"]): r for r in doc["set"]["boundaries"]}
    for cell, row in rows.items():
        mine = built.boundaries[cell]
        assert (row["key"], tuple(row["limits"][f] for f in spec.BOUNDARY_FIELDS), tuple(row["measured"])) == \
               (mine.key, mine.limits, mine.measured)


def test_a_stopped_run_resumes_from_its_output(tmp_path):
    out = tmp_path / "tables.json"
    with pytest.raises(KeyboardInterrupt):
        _run(out, FakeMachine(stop_after=5))
    doc = json.loads(out.read_text())
    assert len(doc["done"]) == 5 and not doc["complete"]
    again = FakeMachine()
    doc = _run(out, again)
    assert [u.key for u in again.measured] == [u.key for u in _plan()[5:]]  # only what was left
    assert doc["complete"] and len(doc["done"]) == 16
    assert len(doc["measurements"]) == len({(r["program"], r["hidden"], r["top_k"], r["shared"], r["tokens"])
                                            for r in doc["measurements"]})  # none twice
    # a third run has nothing left to do
    third = FakeMachine()
    assert _run(out, third)["complete"] and third.measured == []


def test_the_budget_stops_before_a_unit_that_would_end_past_it(tmp_path):
    out = tmp_path / "tables.json"
    machine = FakeMachine()
    doc = _run(out, machine, deadline=35.0)  # 10 s a unit: the fourth would end at 40
    assert len(machine.measured) == 3 and doc["truncated"] and not doc["complete"]
    assert json.loads(out.read_text())["truncated"]
    machine.now = 0.0
    doc = _run(out, machine, deadline=1e9)
    assert doc["complete"] and not doc["truncated"] and len(machine.measured) == 16


def test_an_output_of_another_machine_or_other_programs_is_not_resumed(tmp_path):
    out = tmp_path / "tables.json"
    with pytest.raises(KeyboardInterrupt):
        _run(out, FakeMachine(stop_after=2))
    other = json.loads(json.dumps(STAMP))
    other["gpu"]["product"] = "NVIDIA B200"
    with pytest.raises(ValueError, match=r"^out: .* cannot be resumed here: it was measured on product "
                                         r"'NVIDIA H200', this machine has 'NVIDIA B200'"):
        _run(out, FakeMachine(), stamp=other)
    newer = dict(STAMP, program_set_sha256="0" * 64)
    with pytest.raises(ValueError, match="it measured other programs"):
        _run(out, FakeMachine(), stamp=newer)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="^out: .* is not a tune output"):
        _run(tmp_path / "other.json", FakeMachine())


# ---- what this machine can run ------------------------------------------------------------------------------

def test_emulated_ranks_are_refused_saying_why():
    generated = [2, 4, 8, 16]
    with pytest.raises(ValueError, match=r"^world_sizes: world size 4 needs 4 GPUs, this machine has 2; tune "
                                         r"measures real ranks only.*emulated ranks .* describe no machine"):
        cli.world_sizes_to_measure([2, 4], 2, generated, has_local=False)
    with pytest.raises(ValueError, match="^world_sizes: no programs are generated for world size 3"):
        cli.world_sizes_to_measure([3], 8, generated, has_local=False)
    with pytest.raises(ValueError, match="^world_sizes: world size 1 needs dispatch.LocalWorkspace"):
        cli.world_sizes_to_measure([1], 2, [1, *generated], has_local=False)
    with pytest.raises(ValueError, match="^world_sizes: this machine has 1 GPU"):
        cli.world_sizes_to_measure(None, 1, generated, has_local=False)
    assert cli.world_sizes_to_measure(None, 2, generated, has_local=False) == [2]
    assert cli.world_sizes_to_measure(None, 8, [1, *generated], has_local=True) == [1, 2, 4, 8]
    assert cli.world_sizes_to_measure(None, 1, [1, *generated], has_local=True) == [1]
    assert cli.world_sizes_to_measure([2, 1, 2], 2, [1, *generated], has_local=True) == [1, 2]


def test_the_command_needs_a_gpu_and_gen_programs_runs_it_in_a_subprocess(monkeypatch):
    from click.testing import CliRunner
    result = CliRunner().invoke(cli.main, ["--budget-s", "5"])
    assert result.exit_code == 1 and "tune measures on GPUs: none is visible here" in result.output
    from generator import cli as gen_cli
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda argv, env: calls.append((argv, env)) or
                        subprocess.CompletedProcess(argv, 3))
    result = CliRunner().invoke(gen_cli.main, ["tune", "--budget-s", "60", "--help"])
    assert result.exit_code == 3
    (argv, env), = calls
    assert argv == [sys.executable, "-m", "moe_ar_tools.tune", "--budget-s", "60", "--help"]
    assert str(ROOT) in env["PYTHONPATH"].split(":")


def test_the_generator_never_imports_the_runtime_or_the_tools():
    """gen-programs tune starts the tools in a subprocess: no module of generator/ imports them."""
    import ast
    for path in (ROOT / "generator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not [n for n in names if n.split(".")[0] in ("dispatch", "moe_ar_tools")], (path, names)


def test_a_rank_checks_every_output_against_the_float64_reference():
    """The check that comes before any timing (moe_ar_tools/tune/gpu.py), on CPU tensors: the
    reference's own outputs pass, one wrong element of one input set fails, poisoned outputs fail."""
    import torch

    from moe_ar_tools.tune import gpu
    m = gpu.RankMeasurer.__new__(gpu.RankMeasurer)
    m.torch, m.world_size, m.rank, m.dtype_name, m.dtype = torch, 1, 0, "bf16", torch.bfloat16
    m.calls, m.seed, m.gloo, m.group, m.device, m.l2_bytes, m.point = 3, 5, None, None, torch.device("cpu"), 1 << 16, None
    m._inputs(units.Unit(1, "bf16", 256, 4, True, 8, "plain"))
    assert len(m.sets) == 3 and all(norm.dtype == torch.float32 for _, norm in m.refs)
    outs = [{"residual_out": res.to(torch.bfloat16), "norm_out": norm.to(torch.bfloat16)} for res, norm in m.refs]
    assert m._check(outs, None) == []
    outs[2]["norm_out"][5, 17] += 4.0
    reasons = m._check(outs, None)
    assert len(reasons) == 1 and reasons[0].startswith("norm_out rel err "), reasons
    from moe_ar_tools.bench import outputs
    outputs.poison(outs)
    assert [r.split(" rel err")[0] for r in m._check(outs, None)] == ["residual_out", "norm_out"]


def test_gen_programs_tune_help_names_itself():
    """`gen-programs tune --help` says `gen-programs tune`, not the module it runs; `python -m
    moe_ar_tools.tune --help` keeps its own name."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", "import sys; from generator.cli import main; sys.argv = ['gen-programs', "
                        "'tune', '--help']; main()"], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Usage: gen-programs tune "), r.stdout[:300] + r.stderr[-500:]
    r = subprocess.run([sys.executable, "-m", "moe_ar_tools.tune", "--help"], cwd=root, capture_output=True, text=True)
    assert r.stdout.startswith("Usage: python -m moe_ar_tools.tune "), r.stdout[:300]
