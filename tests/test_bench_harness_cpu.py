"""The one harness on CPU (moe_ar_tools/bench/): the command of every world size and the command lines
tests/run_gpu.sh and the docs give it, the timing core under a fake CUDA (graph capture, the
interleaved event-timed replays), the record format, the header and the provenance stamp, the
writes and the plot, and a world-size-2 rank's records, JSON, summary and plot from fake timings,
read back by the generator's table fitting as the committed results are."""
from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shlex

import pytest
import torch
from click.testing import CliRunner

import dispatch
from generator import table_sets
from moe_ar_tools import provenance
from moe_ar_tools.bench import config, plotting, records, timing
from moe_ar_tools.bench.cli import main
from moe_ar_tools.bench.multi_gpu import config as multi_config
from moe_ar_tools.bench.multi_gpu import summary as multi_summary
from moe_ar_tools.bench.multi_gpu.sweep import Bench
from moe_ar_tools.bench.multi_gpu.systems import System
from moe_ar_tools.bench_one import main as bench_one_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_FILE = table_sets.COMMITTED_SETS[0].files[0]  # the committed world-size-2 benchmark


def _dry(args) -> dict:
    r = CliRunner().invoke(main, [*args, "--dry-run"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])


# ---- the command ------------------------------------------------------------------------------------

def test_one_command_for_every_world_size():
    two = _dry(["--shapes", "7168:8:shared", "--tokens", "1-8", "--profiles", "plain,fp8_tensor"])
    assert two["world_size"] == 2 and two["points"] == 4 * 2 and two["budget_s"] == 420.0
    assert two["systems"] == config.parse_list(multi_config.DEFAULT_SYSTEMS)
    one = _dry(["--world", "1", "--shapes", "7168:8:shared", "--tokens", "1-8", "--profiles", "plain,fp8_tensor"])
    assert one["points"] == 4 * 2 * 2 and one["budget_s"] == 480.0 and one["l2_modes"] == ["cold", "warm"]
    # --time-budget-s is --budget-s; each world size's vocabulary is its own
    assert _dry(["--time-budget-s", "100"])["budget_s"] == _dry(["--budget-s", "100"])["budget_s"] == 100.0
    for args, word in ((["--world", "1", "--profiles", "fp8_group128"], "profile"),
                       (["--profiles", "fp8_group128_row"], "profile"), (["--world", "1", "--systems", "auto"], "system"),
                       (["--systems", "ours"], "system"), (["--world", "0"], "world"), (["--budget-s", "-1"], "budget_s")):
        r = CliRunner().invoke(main, [*args, "--dry-run"])
        assert r.exit_code == 2 and word in r.output, (args, r.output)


@pytest.mark.parametrize("args, option", [(["--world", "1", "--pdl"], "--pdl"),
                                          (["--world", "1", "--machine", "m"], "--machine"),
                                          (["--world", "1", "--no-sweep"], "--sweep"),
                                          (["--compile-modes", "dynamic"], "--compile-modes"),
                                          (["--world", "4", "--l2", "warm"], "--l2"),
                                          (["--no-programs"], "--programs")])
def test_an_option_of_the_other_world_size_is_refused(args, option):
    r = CliRunner().invoke(main, [*args, "--dry-run"])
    assert r.exit_code == 2 and f"{option} is for --world" in r.output, r.output


def test_bench_one_is_the_command_at_world_size_1(capsys):
    args = ["--shapes", "4096:8", "--tokens", "1,64", "--profiles", "nvfp4", "--budget-s", "60", "--dry-run"]
    with pytest.raises(SystemExit) as done:
        bench_one_main(args)
    assert done.value.code == 0
    assert json.loads(capsys.readouterr().out) == _dry(["--world", "1", *args[:-1]])


def _run_gpu_commands() -> list:
    """Every command line tests/run_gpu.sh gives the benchmark, its variables at their defaults."""
    text = (ROOT / "tests" / "run_gpu.sh").read_text().replace("\\\n", " ")
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    commands = []
    for line in text.splitlines():
        m = re.search(r"(?:python3 -m moe_ar_tools\.bench(?!_)|\$BENCH) (.*?) 2>&1", line)
        if m:
            variants = ["", "--pdl", "--vec-per-thread 4"] if "$variant" in m.group(1) else [""]
            commands += [shlex.split(m.group(1).replace("$variant", v).replace("$OUT", "out")) for v in variants]
    return commands


def test_the_gpu_scripts_command_lines_parse():
    commands = _run_gpu_commands()
    assert len(commands) == 7 and sum(c[:2] == ["--world", "1"] for c in commands) == 1, commands
    for args in commands:
        _dry(args)


def test_the_documented_command_lines_parse():
    _dry(["--world", "1", "--out", "out", "--shapes", "7168:8:shared", "--tokens", "1,16,32,128,256,1024,2048,8192",
          "--profiles", "plain,fp8_group128_row,nvfp4,fp8_tensor",
          "--systems", "ours,ours_pdl,triton_fused,chain,torch_compile", "--compile-modes", "dynamic",
          "--no-programs", "--budget-s", "300"])
    for doc in ("docs/contributing.md", "docs/measurement.md"):
        for line in re.findall(r"^\s+moe-ar-bench (.*?)(?:\s+#.*)?$", (ROOT / doc).read_text(), re.M):
            _dry(shlex.split(line))


# ---- the timing core under a fake CUDA ---------------------------------------------------------------

class _Clock:
    now = 0.0


class _Event:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _Clock.now

    def elapsed_time(self, end):
        return end.t - self.t


class _Graph:
    def __init__(self):
        self.calls = []

    def replay(self):  # replaying graph j takes j + 1 ms on the fake clock
        _Clock.now += self.cost
        self.log.append(self.name)


@pytest.fixture
def fake_cuda(monkeypatch):
    captures = []

    @contextlib.contextmanager
    def graph(g, capture_error_mode=None):
        captures.append(("begin", capture_error_mode))
        yield
        captures.append(("end", capture_error_mode))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return captures


def test_capture_graph_warms_up_then_captures_the_calls(fake_cuda):
    made = []
    # world size 2+'s rotation: warm-up every input set at least once, the captured calls over the sets
    graph, captured, first = timing.capture_graph(lambda i: made.append(i % 3) or i, 5, range(max(2, 3)), "cpu")
    assert made == [0, 1, 2] + [0, 1, 2, 0, 1] and captured == [0, 1, 2, 3, 4] and first is None
    assert isinstance(graph, _Graph) and fake_cuda == [("begin", "thread_local"), ("end", "thread_local")]
    made.clear()
    _, _, first = timing.capture_graph(made.append, 2, [0, 1, 0], "cpu", time_first=True)  # world size 1's
    assert made == [0, 1, 0, 0, 1] and first >= 0.0


def test_timed_replays_interleave_every_graph_once_a_round(fake_cuda):
    log = []
    graphs = []
    for j in range(3):
        g = _Graph()
        g.cost, g.log, g.name = j + 1.0, log, j
        graphs.append(g)
    ms = timing.timed_replays(graphs, 7, 1234, "cpu")
    assert ms == [[1.0] * 7, [2.0] * 7, [3.0] * 7]  # [graph][replay], each its own events
    rounds = [log[3 * r:3 * r + 3] for r in range(7)]
    assert rounds == timing.replay_orders(3, 7, 1234)


# ---- records, header, stamp, writes, plot -------------------------------------------------------------

def test_a_record_from_its_replays():
    r = records.make_record(system="auto", world_size=2, dtype="bf16", hidden=256, top_k=4, shared=True,
                            profile="plain", tokens=8, valid=True, replay_us=[3.0, 1.0, 2.0, 4.0, 5.0], roofline_us=1.0)
    assert tuple(r)[:len(records.RECORD_KEYS)] == records.RECORD_KEYS
    assert (r["median_us"], r["p10_us"], r["p90_us"], r["min_us"]) == (3.0, 1.4, 4.6, 1.0) and "replay_us" not in r
    kept = records.make_record(system="ours", world_size=1, dtype="bf16", hidden=256, top_k=4, shared=True,
                               profile="plain", tokens=8, valid=True, replay_us=[2.0], keep_replays=True)
    assert kept["replay_us"] == [2.0] and kept["roofline_us"] is None
    with pytest.raises(ValueError, match="not both"):
        records.make_record(system="auto", world_size=2, dtype="bf16", hidden=256, top_k=4, shared=True,
                            profile="plain", tokens=8, valid=True, replay_us=[2.0], median_us=2.0)
    with pytest.raises(ValueError, match="profile"):
        records.make_record(system="ours", world_size=1, dtype="bf16", hidden=256, top_k=4, shared=True,
                            profile="fp8_group128_row", tokens=8, valid=True, median_us=2.0)


class _FakeNvml:
    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return b"580.1"


def test_the_stamp_every_result_starts_with(monkeypatch):
    assert set(provenance.versions()) == {"torch", "cuda", "python", "cupy", "triton", "nccl"}
    assert provenance.driver_version(_FakeNvml()) == "580.1"
    monkeypatch.setattr(provenance, "_tools_driver", lambda: None)
    assert provenance.driver_version(None) == "unknown"
    monkeypatch.setenv("MOE_AR_COMMIT", "abc123")
    head = records.run_header(gpu="NVIDIA H200", world_size=2, dtype="bf16", l2_bytes=1 << 20, config={"a": 1})
    assert list(head) == ["gpu", "commit", "date", "driver", "versions", "world_size", "dtype", "l2_bytes", "config"]
    assert head["commit"] == "abc123" and head["driver"] == "unknown"


def test_write_json_is_whole_and_a_failed_plot_is_only_logged(tmp_path):
    out = tmp_path / "a" / "r.json"
    records.write_json(out, {"x": float("nan"), "y": [1.5]})
    assert json.loads(out.read_text()) == {"x": None, "y": [1.5]} and [p.name for p in out.parent.iterdir()] == ["r.json"]
    said = []

    def broken(result, path):
        raise RuntimeError("no display")
    records.write_report(tmp_path / "t.md", "table\n", broken, {}, tmp_path / "p.png", log=said.append)
    assert (tmp_path / "t.md").read_text() == "table\n" and said == ["plot failed: RuntimeError: no display"]


def test_the_plot_draws_a_grid_of_panels(tmp_path):
    pytest.importorskip("matplotlib")
    panel = plotting.Panel("p", [plotting.Line("a", [(2, 3.0), (1, 2.0)]), plotting.Line("b", [(1, 4.0)], "--", 1)],
                           [(1, 1.0), (2, 1.5)], hline=(0.5, "floor"))
    plotting.draw([[panel, panel], [panel]], tmp_path / "g.png", "title")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


# ---- a world-size-2 rank's results from fake timings ---------------------------------------------------

def _checks():
    clean = {"reasons": [], "residual_rel_err": 1e-3, "norm_rel_err": 1e-3, "nvfp4_rel_err": None, "fp8_rel_err": None}
    return {"before": dict(clean), "after": dict(clean)}


def _fake_rank(tmp_path) -> tuple:
    """Rank 0 of a world of 2 after two token counts of one shape, its systems' replays made up (the
    forced programs 1.0 .. N us, auto the first, the NCCL baseline 10 us), then its final write."""
    cfg = config.make_config(multi_config.VOCABULARY, world=2, shapes="256:4:shared", tokens="1,8", profiles="plain",
                             reps=5, calls=2, warmup=1, out=str(tmp_path / "run.json"))
    bench = object.__new__(Bench)
    bench.cfg, bench.rank, bench.W, bench.records, bench.skipped, bench.truncated = cfg, 0, 2, [], [], False
    bench.bandwidth = {"hbm_GBps": 4000.0, "nvlink_GBps": 400.0}
    programs = [n for n in dispatch.programs()
                if (dispatch.program_info(n)["world_size"], dispatch.program_info(n)["dtype"],
                    dispatch.program_info(n)["profile"]) == (2, "bf16", "plain")]
    for T in cfg.tokens:
        systems = [System("nccl+torch", "two_shot", None, []), System("auto", "one_shot", None, [], program=programs[0])]
        systems += [System(name, "two_shot", None, [], program=name) for name in programs]
        times = [[10.0 + 0.1 * i for i in range(5)], [1.0 + 0.1 * i for i in range(5)]]
        times += [[1.0 + k + 0.1 * i for i in range(5)] for k in range(len(programs))]
        for s in systems:
            s.checks = _checks()
        bench.records_for(cfg.shapes[0], T, "plain", systems, times, 3)
    result = {"machine": "fake", **records.run_header(gpu="NVIDIA H200", world_size=2, dtype="bf16", l2_bytes=1 << 16,
                                                      config={"tokens": cfg.tokens}),
              "emulated": False, "bandwidth": bench.bandwidth}
    table = bench.write(result, pathlib.Path(cfg.out), final=True)
    return json.loads(pathlib.Path(cfg.out).read_text()), table, programs


def test_a_world_size_2_rank_writes_what_the_table_fitting_reads(tmp_path):
    doc, table, programs = _fake_rank(tmp_path)
    assert doc["complete"] is True and doc["gpu"] == "NVIDIA H200" and doc["world_size"] == 2
    assert (tmp_path / "run.summary.txt").read_text() == table + "\n" and "256/4s" in table
    auto = next(r for r in doc["records"] if r["system"] == "auto" and r["tokens"] == 8)
    assert auto["ratio_vs_nccl_torch"] == pytest.approx(1.2 / 10.2) and auto["program"] == programs[0]
    assert auto["median_us"] == pytest.approx(1.2) and (auto["p10_us"], auto["p90_us"]) == pytest.approx((1.04, 1.36))
    # the generator fits its table sets to these fields of the same file format
    cells = table_sets.parse_measurements(doc, "run.json").cells[("bf16", 2, "plain")]
    assert set(cells) == {(256, 4, True, 1), (256, 4, True, 8)}
    families = {dispatch.program_info(n)["family"]: k for k, n in enumerate(programs)}
    for family, k in families.items():
        assert cells[(256, 4, True, 8)][family].median_us == pytest.approx(1.2 + k)
        assert cells[(256, 4, True, 8)][family].noise_us == pytest.approx(0.16)
    # every field of the committed benchmark's records and header is still written
    committed = json.loads((ROOT / BENCH_FILE).read_text())
    kept = set(auto) | {"variant", "symm_variant", "symm_compiled_variant", "invalid_reason",
                        "ratio_of_medians_vs_nccl_torch_plain", "ratio_of_medians_vs_auto_plain",
                        "ratio_vs_symm_torch", "ratio_vs_nccl_compiled", "ratio_vs_symm_compiled",
                        "ratio_vs_auto_plus_quant", "symm_backend"}
    assert {k for r in committed["records"] for k in r} <= kept
    assert {"gpu", "world_size", "driver", "versions", "commit", "date", "config", "bandwidth"} <= set(doc)
    assert set(committed) - set(doc) <= {"compile", "cold_start", "env", "truncated", "skipped", "wall_s", "records"} | \
        set(doc)


def test_the_world_size_2_plot_from_its_records(tmp_path):
    pytest.importorskip("matplotlib")
    _fake_rank(tmp_path)
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    committed = json.loads((ROOT / BENCH_FILE).read_text())
    committed["records"] = [r for r in committed["records"] if r["hidden"] == 7168 and r["top_k"] == 8 and r["shared"]]
    multi_summary.plot(committed, tmp_path / "committed.png")  # a committed result still draws
    assert (tmp_path / "committed.png").read_bytes()[:4] == b"\x89PNG"
