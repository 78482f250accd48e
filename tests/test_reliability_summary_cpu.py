"""moe_ar_tools/reliability_summary.py on synthetic inputs (CPU): totals, sections, PASS/FAIL, bad input."""
from __future__ import annotations

import json

import pytest
import torch

from moe_ar_tools import reliability_summary as rs
from moe_ar_tools.soak import runner
from test_soak_cpu import FakeWorld, _soak_args

GPU = dict(gpu="NVIDIA H200", gpus=2, base_seed=1, time="2026-12-01T00:00:00")


def _records():
    t = "tests/test_gpu_reliability.py::"
    return [
        dict(GPU, test=t + "test_late_rank[ws2-1gpu-oneshot-deadline20ms]", kind="reliability",
             what="late rank (~100 ms)", world_size=2, devices="one_gpu", regime="oneshot", timeout_s=0.02,
             delay_ms=104.2, faults_injected=1, calls=4, passed=True, seconds=0.4,
             outcome="1 rank(s) raised 'timed out', 1 correct, none wrong; reset, 2 fresh calls correct"),
        dict(GPU, test=t + "test_rank_stops_mid_exchange[4-twoshot-half_the_units]", kind="reliability",
             what="rank stops mid-exchange", world_size=4, devices="one_gpu", regime="twoshot", timeout_s=0.2,
             stop_after_units=600, wall_s=0.21, faults_injected=1, calls=5, passed=True, seconds=0.6,
             outcome="ranks [0, 1, 3] raised"),
        dict(GPU, test=t + "test_hostile_calls_are_named_and_leave_the_world_healthy", kind="reliability",
             what="hostile input (hypothesis) then valid calls", world_size=2, devices="one_gpu", hostile_calls=57,
             faults_injected=0, calls=3, passed=True, seconds=2.0, outcome="57 hostile calls"),
        dict(GPU, test=t + "test_create_close_cycles_leak_no_device_memory", kind="reliability",
             what="EmulatedWorld create/close cycles", world_size=2, devices="one_gpu", cycles_done=1000,
             device_memory_drift_bytes=0, faults_injected=0, calls=10, passed=True, seconds=3.1, outcome="ok"),
        dict(GPU, test=t + "test_two_groups_and_ipc_cycles_two_processes", kind="reliability",
             what="two process groups in one process, then Workspace create/close cycles over CUDA IPC", rank=0,
             world_size=2, devices="two_gpus", cycles_done=1000, calls=27, faults_injected=0, passed=True,
             seconds=30.0, outcome="ok"),
        dict(GPU, test=t + "test_two_groups_and_ipc_cycles_two_processes", kind="reliability",
             what="two process groups in one process, then Workspace create/close cycles over CUDA IPC", rank=1,
             world_size=2, devices="two_gpus", cycles_done=1000, calls=27, faults_injected=0, passed=True,
             seconds=30.0, outcome="ok"),
        dict(GPU, test="tests/test_gpu_correctness.py::test_program_matches_reference[x]", cases=6, passed=True),
    ]


@pytest.fixture(scope="module")
def soak_result():
    r = runner.Soak(_soak_args(2, 60), world=FakeWorld(2, 40, 64, torch.bfloat16)).run()
    r["machine"] = dict(gpu="NVIDIA H200", gpus=2, hostname="gpu-host")
    r["commit"] = "abc1234"
    return r


def _write(tmp_path, records, soaks):
    tests = tmp_path / "gpu-tests.jsonl"
    tests.write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = []
    for i, s in enumerate(soaks):
        p = tmp_path / f"soak-{i}.json"
        p.write_text(json.dumps(s))
        paths.append(str(p))
    return str(tests), paths


def test_summary_of_a_passing_run(tmp_path, soak_result):
    s4 = dict(soak_result, world_size=4, calls=100_000, eager_calls=50_000, graph_calls=50_000, seconds=180.0)
    tests, soaks = _write(tmp_path, _records(), [soak_result, s4])
    out = tmp_path / "bench_results" / "reliability" / "summary.md"
    assert rs.main(["--tests", tests, "--soak", *soaks, "--out", str(out), "--strict"]) == 0
    md = out.read_text()
    assert md.startswith("# Reliability") and "(PASS)" in md.splitlines()[0]
    assert "2x NVIDIA H200 (gpu-host)" in md and "abc1234" in md
    total = soak_result["calls"] + 100_000 + 4 + 5 + 3 + 10 + 27
    assert f"| calls made (soak + reliability tests) | {total:,} |" in md
    assert "| faults injected (late ranks, ranks stopped mid-exchange) | 2 |" in md
    assert "| hostile calls (each a ValueError naming the argument) | 57 |" in md
    assert "| reliability tests passed / run | 6 / 6 |" in md
    for title in ("## Soak", "## Faults: a late rank", "## Faults: a rank stops mid-exchange", "## Hostile input",
                  "## Lifetimes", "## Other GPU tests in the same run"):
        assert title in md, title
    assert "test_late_rank[ws2-1gpu-oneshot-deadline20ms]" in md and "104.2" in md
    assert "eager calls only" in md  # the graph note of the soak


def test_summary_fails_on_a_wrong_element_or_a_failed_test(tmp_path, soak_result):
    bad = dict(soak_result, wrong_elements=3, passed=False)
    tests, soaks = _write(tmp_path, _records(), [bad])
    out = tmp_path / "s.md"
    assert rs.main(["--tests", tests, "--soak", *soaks, "--out", str(out)]) == 0
    assert "(FAIL)" in out.read_text().splitlines()[0]
    assert rs.main(["--tests", tests, "--soak", *soaks, "--out", str(out), "--strict"]) == 1
    recs = _records()
    recs[1]["passed"] = False
    recs[1]["error"] = "ranks [0] raised | ..."
    tests, soaks = _write(tmp_path, recs, [soak_result])
    text, ok = rs.summarize(rs.load_jsonl(tests), [rs.load_soak(s) for s in soaks])
    assert not ok and "5 / 6" in text and "ranks [0] raised \\| ..." in text


def test_summary_rejects_bad_input(tmp_path, capsys):
    p = tmp_path / "x.jsonl"
    p.write_text("{not json\n")
    assert rs.main(["--tests", str(p)]) == 2
    q = tmp_path / "s.json"
    q.write_text(json.dumps({"hello": 1}))
    assert rs.main(["--soak", str(q)]) == 2
    assert rs.main([]) == 2
    assert "nothing to summarize" in capsys.readouterr().err


def test_the_gpu_tests_records_are_what_the_summary_reads():
    """gpu_worlds.recording, the one helper the GPU tests record through, as a reliability test and a
    correctness test use it: a pass, a failure (recorded, then raised) and a skip (not recorded), read
    back by the summary."""
    from gpu_worlds import recording
    records = []

    def record_result(test):
        return lambda **fields: records.append(dict(GPU, test=test, **fields))

    reliability = dict(kind="reliability", calls=0, faults_injected=0)  # test_gpu_reliability.RELIABILITY
    late = record_result("tests/test_gpu_reliability.py::test_late_rank[x]")
    with recording(late, **reliability, what="late rank (~100 ms)", world_size=2, devices="one_gpu") as info:
        info["calls"] += 3
        info["faults_injected"] += 1
        info["outcome"] = "1 rank(s) raised 'timed out'"
    with pytest.raises(AssertionError, match="rank 1 was wrong"):
        with recording(record_result("tests/test_gpu_reliability.py::test_rank_stops_mid_exchange[x]"),
                       **reliability, what="rank stops mid-exchange", world_size=4, devices="one_gpu") as info:
            info["calls"] += 2
            info["outcome"] = "not reached"
            raise AssertionError("rank 1 was wrong")
    with pytest.raises(pytest.skip.Exception):
        with recording(late, **reliability, what="late rank (~100 ms)", world_size=2, devices="two_gpus"):
            pytest.skip("needs two GPUs")
    with recording(record_result("tests/test_gpu_correctness.py::test_program_matches_reference[x]"),
                   cases=0, program="moe_ar_os_bf16_ws2_o110") as info:
        info["cases"] += 6
    assert len(records) == 3
    passed, failed, other = records
    assert passed["passed"] is True and "error" not in passed and passed["seconds"] >= 0
    assert failed["passed"] is False and failed["outcome"] == "FAILED"
    assert failed["error"] == "AssertionError: rank 1 was wrong" and failed["calls"] == 2
    assert other["cases"] == 6 and other["passed"] is True
    text, ok = rs.summarize(records, [])
    assert not ok
    assert "| reliability tests passed / run | 1 / 2 |" in text
    assert "reliability test calls (valid calls, each checked in full) | 5 |" in text
    assert "| faults injected (late ranks, ranks stopped mid-exchange) | 1 |" in text
    assert "AssertionError: rank 1 was wrong" in text and "1 records, 0 failed" in text
