"""The selection tables read one named benchmark file (tuning.BENCH_FILE), nothing else in bench_results/."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from generator import render, tuning

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_named_benchmark_is_committed_and_the_only_bench_input():
    path = ROOT / tuning.BENCH_FILE
    assert path.is_file(), tuning.BENCH_FILE
    assert tuning.bench_files(ROOT) == [path]
    bench_inputs = [p for p in render.input_files(ROOT) if p.startswith("bench_results/")]
    assert bench_inputs == [tuning.BENCH_FILE]
    doc = json.loads(path.read_text())
    assert doc["complete"] and not doc["emulated"] and doc["world_size"] == 2


def test_another_json_beside_it_changes_nothing(tmp_path):
    dest = tmp_path / tuning.BENCH_FILE
    dest.parent.mkdir(parents=True)
    shutil.copyfile(ROOT / tuning.BENCH_FILE, dest)
    # A stray result (a new run not yet named, or an experiment) with every point made 10x slower
    # for the one-shot: it would move the boundaries if it were read.
    doc = json.loads(dest.read_text())
    for r in doc["records"]:
        if r["system"].startswith("moe_ar_os_"):
            r["median_us"] *= 10
    (dest.parent / "h200x2-new-run-bf16.json").write_text(json.dumps(doc))
    selection = tuning.selection(tmp_path)
    assert selection == tuning.selection(ROOT)
    assert selection.source.startswith(f"cells measured in {tuning.BENCH_FILE}, ")


def test_a_missing_benchmark_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"^tuning: the benchmark the tables are fitted to, bench_results/"):
        tuning.selection(tmp_path)
