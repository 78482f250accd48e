"""The table sets read the measurement files their declarations name (generator/table_sets.py
COMMITTED_SETS), nothing else in bench_results/, and check each file's stamp against its set."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from generator import fit, render, spec, table_sets

ROOT = pathlib.Path(__file__).resolve().parent.parent
H200_FILE = table_sets.COMMITTED_SETS[0].files[0]


def test_the_named_files_are_committed_and_the_only_bench_inputs():
    named = [rel for declared in table_sets.COMMITTED_SETS for rel in declared.files]
    for rel in named:
        assert (ROOT / rel).is_file(), rel
    assert table_sets.input_files(ROOT) == [ROOT / rel for rel in named]
    bench_inputs = [p for p in render.input_files(ROOT) if p.startswith("bench_results/")]
    assert bench_inputs == sorted(named)
    doc = json.loads((ROOT / H200_FILE).read_text())
    assert doc["complete"] and not doc["emulated"] and doc["world_size"] == 2 and doc["gpu"] == "NVIDIA H200"


def _copy(tmp_path) -> pathlib.Path:
    """Every file the committed sets name, copied under tmp_path; the path of the world-size-2 one."""
    for declared in table_sets.COMMITTED_SETS:
        for rel in declared.files:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, tmp_path / rel)
    return tmp_path / H200_FILE


def test_another_json_beside_it_changes_nothing(tmp_path):
    dest = _copy(tmp_path)
    # A stray result (a new run not yet named, or an experiment) with every point made 10x slower
    # for the one-shot: it would move the boundaries if it were read.
    doc = json.loads(dest.read_text())
    for r in doc["records"]:
        if r["system"].startswith("moe_ar_os_"):
            r["median_us"] *= 10
    (dest.parent / "h200x2-new-run-bf16.json").write_text(json.dumps(doc))
    assert table_sets.table_sets(tmp_path) == table_sets.table_sets(ROOT)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"^table_sets: bench_results/\S+, a file a committed set is fitted to, is "
                                         r"missing"):
        table_sets.table_sets(tmp_path)


def test_a_file_whose_stamp_is_not_its_sets_is_refused(tmp_path):
    dest = _copy(tmp_path)
    doc = json.loads(dest.read_text())
    doc["gpu"] = "NVIDIA H100 80GB HBM3"
    dest.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"^table_sets: \S+: product 'NVIDIA H100 80GB HBM3', but the set "
                                         r"h200_nvlink is for 'NVIDIA H200'"):
        table_sets.table_sets(tmp_path)


def test_only_forced_valid_programs_are_read(tmp_path):
    """auto's records name the program it chose in `program`: they are not that program's times."""
    measurements = table_sets.read_measurements(ROOT, H200_FILE)
    doc = json.loads((ROOT / H200_FILE).read_text())
    forced = {(spec.parse_recorded(r["system"]), r["hidden"], r["top_k"], r["shared"], r["tokens"]): r["median_us"]
              for r in doc["records"] if r["system"].startswith("moe_ar_") and r["valid"]}
    read = 0
    for (dtype, world_size, profile), points in measurements.cells.items():
        for (hidden, top_k, shared, tokens), times in points.items():
            for family, time in times.items():
                cell = spec.ProgramSpec(family, dtype, world_size, profile)
                assert time.median_us == forced[(cell, hidden, top_k, shared, tokens)]
                read += 1
    assert read == len(forced)


def test_the_committed_files_keep_their_code_form_names_and_read_as_renamed():
    """The committed measurements name programs as they were measured: by family code
    (moe_ar_os_bf16_ws2_plain) in the files from before names spelled the family, by today's names in
    the later ones, never mixed in a file; reading them maps each code to its family
    (spec.parse_recorded), so the same file with today's names gives the same cells, point for point."""
    for declared in table_sets.COMMITTED_SETS:
        for rel in declared.files:
            doc = json.loads((ROOT / rel).read_text())
            field, records = ("program", doc["measurements"]) if "measurements" in doc else ("system", doc["records"])
            names = {r[field] for r in records if r[field].startswith("moe_ar_")}
            coded = [spec.parse_recorded(n).name != n for n in names]
            assert names and (all(coded) or not any(coded)), rel  # all in the code form, or all in today's
            for record in records:
                if record[field].startswith("moe_ar_"):
                    record[field] = spec.parse_recorded(record[field]).name
            assert table_sets.parse_measurements(doc, rel) == table_sets.read_measurements(ROOT, rel), rel


def test_the_key_comparison_in_the_readme_is_current():
    """bench_results/tuning/README.md holds key_comparison's output verbatim (rerun
    `python -m generator.table_sets` and paste it when the fit or the benchmark changes)."""
    text = (ROOT / "bench_results" / "tuning" / "README.md").read_text()
    assert table_sets.key_comparison(ROOT, H200_FILE).strip() in text
    assert "## The choice: bytes per rank" in text and fit.FIT_KEY == "bytes_per_rank"
