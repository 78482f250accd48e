"""The generator: enumeration, names, determinism, the --check gate, diff, the
manifest verifier and the emitted C++ tables. No GPU, no CUDA needed."""
from __future__ import annotations

import ast
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from generator import manifest as manifest_mod
from generator import policy, render, spec, tuning, verify
from generator.diffing import diff_manifests
from generator.enumeration import enumerate_programs

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"


def run_cli(args, cwd, env_extra=None, pythonpath=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pythonpath or cwd)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "generator.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def copy_repo(dest: pathlib.Path) -> pathlib.Path:
    """The generator's inputs and the committed outputs, in a scratch folder."""
    for name in ("generator", "templates", "generated", "bench_results"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def tree_bytes(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def rendered():
    return render.render_all(ROOT)


@pytest.fixture(scope="module")
def manifest(rendered):
    return json.loads(rendered.outputs["manifest.json"])


# ---- enumeration and names ----------------------------------------------------------

def test_enumeration_is_product_minus_holes():
    enumeration = enumerate_programs()
    product = [spec.ProgramSpec(*cell) for cell in itertools.product(
        spec.FAMILIES, spec.DTYPES, spec.WORLD_SIZES, spec.OUTPUT_PROFILES)]
    holes = {h.spec for h in enumeration.holes}
    assert {h.spec for h in enumeration.holes} == {c for c in product if policy.hole_reason(c)}
    assert list(enumeration.programs) == [c for c in product if c not in holes]
    assert len(enumeration.programs) + len(enumeration.holes) == len(product)
    for hole in enumeration.holes:
        assert hole.reason == policy.hole_reason(hole.spec)
        fallback = spec.ProgramSpec(hole.fallback_family, hole.spec.dtype, hole.spec.world_size, hole.spec.profile)
        assert policy.is_supported(fallback)
        assert spec.PROTOCOL[hole.fallback_family] == spec.PROTOCOL[hole.spec.family]


def test_root_family_hole_is_refused():
    with pytest.raises(ValueError, match="root family"):
        enumerate_programs(is_supported=lambda s: s.family != "twoshot", hole_reason=lambda s: "test")


@pytest.mark.parametrize("cell", list(spec.all_cells()), ids=lambda c: c.name)
def test_names_round_trip(cell):
    assert spec.parse(cell.name) == cell
    assert cell.symbol == cell.name and cell.file_name == f"programs/{cell.name}.cu"


@pytest.mark.parametrize("bad", ["moe_ar_xx_bf16_ws4_o110", "moe_ar_ts_bf32_ws4_o110", "moe_ar_ts_bf16_ws3_o110",
                                 "moe_ar_ts_bf16_ws4_o112", "ts_bf16_ws4_o110", "moe_ar_ts_bf16_ws4_o110.cu"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        spec.parse(bad)


def test_every_family_has_all_its_tables():
    for table in (spec.FAMILY_MEANING, spec.BASE_FAMILY, spec.PROTOCOL, spec.FAMILY_SHORT, spec.FAMILY_CAMEL,
                  spec.FAMILY_REGIME):
        assert set(table) == set(spec.FAMILIES)
    assert len(set(spec.FAMILY_SHORT.values())) == len(spec.FAMILIES)


def test_every_profile_has_all_its_tables():
    """Adding an output profile is one place: the tuples and tables of spec.py (plus its math in
    the template); every name derived from it parses back."""
    for table in (spec.OUTPUT_PROFILE_MEANING, spec.PROFILE_QUANT, spec.PROFILE_CPP, spec.PROFILE_EXTRA_OUTPUTS):
        assert set(table) == set(spec.OUTPUT_PROFILES)
    # the pipelined two-shot with register loads is generated for the profiles with loads, a hole elsewhere
    assert set(spec.PIPELINED_LOADS) <= set(spec.OUTPUT_PROFILES)
    for profile in spec.OUTPUT_PROFILES:
        cell = spec.ProgramSpec("twoshot_pipelined_loads", "bf16", 2, profile)
        assert policy.is_supported(cell) == (profile in spec.PIPELINED_LOADS), profile
    assert len(set(spec.PROFILE_QUANT.values())) == len(spec.OUTPUT_PROFILES)
    for cell in spec.all_cells():
        assert spec.parse(cell.name) == cell
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cell.symbol), cell.symbol  # a C identifier


def test_selection_covers_every_cell():
    selection = tuning.selection()
    assert set(selection.boundaries) == set(itertools.product(spec.DTYPES, spec.WORLD_SIZES, spec.OUTPUT_PROFILES))
    # World size 8 has no machine here: the written model, and the table says so.
    assert selection.boundaries[("bf16", 8, "111")] == tuning.Boundaries(
        tuning.MODEL_ONESHOT_MAX_TOKENS[8], tuning.MODEL_EARLY_MAX_TOKENS[8], tuning.ALL_TOKENS, tuning.ALL_TOKENS,
        tuning.MODEL_SOURCE)
    # World size 2 was measured (bench_results/), and fp16 borrows the bf16 measurement.
    assert selection.boundaries[("bf16", 2, "110")].source.startswith("measured")
    assert selection.boundaries[("fp16", 2, "110")].source.startswith("measured (bf16 data")


def _times(**families):
    """Synthetic measurements: one shape, family -> {T: us}."""
    points = {}
    for family, by_t in families.items():
        for T, us in by_t.items():
            points.setdefault((7168, 8, True, T), {})[family] = us
    return points


def test_fit_boundaries_follows_the_measurements():
    # one-shot fastest to 64, early fastest at 128..256, two-shot from 512
    points = _times(oneshot={1: 5, 64: 10, 128: 30, 256: 60},
                    twoshot_early={1: 9, 64: 12, 128: 20, 256: 40, 512: 90, 1024: 200},
                    twoshot={1: 12, 64: 15, 128: 25, 256: 45, 512: 80, 1024: 150})
    a, b, c, d, worst, ratio, over, over_at_target = tuning.fit_boundaries(points)
    # the pipelined two-shots were not measured: never chosen, not even above the measured range
    assert (a, b, c, d) == (64, 256, tuning.ALL_TOKENS, tuning.ALL_TOKENS) and ratio == pytest.approx(1.0)
    assert worst == 1.0
    assert over == over_at_target == 0
    # never picks one-shot where one-shot was not measured (a workspace cap)
    points = _times(oneshot={1: 1}, twoshot_early={1: 9, 2: 9}, twoshot={1: 12, 2: 12})
    assert tuning.fit_boundaries(points)[:4] == (1, 2, tuning.ALL_TOKENS, tuning.ALL_TOKENS)
    # pipelined fastest from 1024: it takes over there; the two-shot keeps 512
    points = _times(oneshot={1: 5, 64: 10, 128: 30, 256: 60},
                    twoshot_early={1: 9, 64: 12, 128: 20, 256: 40, 512: 90, 1024: 200, 2048: 400},
                    twoshot={1: 12, 64: 15, 128: 25, 256: 45, 512: 80, 1024: 150, 2048: 300},
                    twoshot_pipelined={1: 30, 64: 30, 128: 40, 256: 60, 512: 85, 1024: 140, 2048: 270})
    assert tuning.fit_boundaries(points)[:4] == (64, 256, 512, 512)
    # the pipelined two-shot with register loads fastest at 1024 only: it takes that range, the
    # ring the rest; a tie with the ring leaves it out (loads_max_tokens == twoshot_max_tokens)
    for T, us in {256: 70, 512: 86, 1024: 130, 2048: 280}.items():
        points[(7168, 8, True, T)]["twoshot_pipelined_loads"] = us
    assert tuning.fit_boundaries(points)[:4] == (64, 256, 512, 1024)
    points[(7168, 8, True, 1024)]["twoshot_pipelined_loads"] = 140
    assert tuning.fit_boundaries(points)[:4] == (64, 256, 512, 512)
    for times in points.values():
        times.pop("twoshot_pipelined_loads", None)
    # without the two-shot measured, the pipelined one follows the early one directly
    # (twoshot_max_tokens == early_max_tokens: no T runs the two-shot)
    for times in points.values():
        del times["twoshot"]
    assert tuning.fit_boundaries(points)[:4] == (64, 256, 256, 256)


def test_fit_boundaries_counts_points_over_the_target_first():
    """The target is per point (within 5% of the best program): a rule with fewer points over it
    wins even where its mean slowdown is larger."""
    points = {(4096, 8, False, 1): {"oneshot": 100, "twoshot_early": 115},
              (7168, 8, True, 1): {"oneshot": 106, "twoshot_early": 100},
              (7168, 4, True, 1): {"oneshot": 106, "twoshot_early": 100}}
    a, b, c, d, worst, mean, over, over_at_target = tuning.fit_boundaries(points)
    assert (a, b, c, d) == (0, 1, tuning.ALL_TOKENS, tuning.ALL_TOKENS)  # the early two-shot: one point over, not two
    assert over == 1 and over_at_target == 0 and worst == pytest.approx(1.15)
    assert mean == pytest.approx(1.15 ** (1 / 3))


def test_fit_boundaries_counts_the_target_shape_before_the_others():
    """A point over the target at the issue's shape (TARGET_SHAPE) outweighs any number elsewhere."""
    assert tuning.TARGET_SHAPE == (7168, 8, True)
    points = {(7168, 8, True, 1): {"oneshot": 100, "twoshot_early": 106},
              (7168, 8, False, 1): {"oneshot": 110, "twoshot_early": 100},
              (4096, 8, False, 1): {"oneshot": 110, "twoshot_early": 100}}
    a, b, c, d, worst, mean, over, over_at_target = tuning.fit_boundaries(points)
    assert (a, b, c, d) == (1, 1, tuning.ALL_TOKENS, tuning.ALL_TOKENS)  # the one-shot: two over, none at the target shape
    assert over == 2 and over_at_target == 0 and worst == pytest.approx(1.1)
    # the same points with the shapes swapped: the early two-shot, one point over, at another shape
    points = {(4096, 8, False, 1): points[(7168, 8, True, 1)], (7168, 8, True, 1): points[(7168, 8, False, 1)],
              (7168, 4, True, 1): points[(4096, 8, False, 1)]}
    assert tuning.fit_boundaries(points)[:4] == (0, 1, tuning.ALL_TOKENS, tuning.ALL_TOKENS)


# ---- rendering ----------------------------------------------------------------------

def test_generation_is_deterministic_across_runs_dirs_cwd_and_hash_seed(rendered, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    render.write_tree(rendered.outputs, first)
    render.write_tree(render.render_all(ROOT).outputs, second)
    assert tree_bytes(first) == tree_bytes(second) == rendered.outputs.as_dict()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for seed in ("0", "12345"):
        out = tmp_path / f"seed{seed}"
        r = run_cli(["--out", str(out)], cwd=elsewhere, pythonpath=ROOT, env_extra={"PYTHONHASHSEED": seed})
        assert r.returncode == 0, r.stderr
        assert tree_bytes(out) == rendered.outputs.as_dict()


def test_outputs_name_no_absolute_path_and_carry_header(rendered):
    for rel, data in rendered.outputs.items():
        text = data.decode("utf-8")
        assert str(ROOT) not in text and "/tmp" not in text and "/home" not in text, rel
        assert text.endswith("\n"), rel
        if rel.endswith((".cu", ".cuh", ".h")):
            assert text.startswith("// GENERATED FILE, DO NOT EDIT"), rel
            assert f"// inputs sha256: {rendered.inputs_sha256}\n" in text, rel
            assert "gen-programs, generator/" in text.splitlines()[0], rel
    header = json.loads(rendered.outputs["manifest.json"])["_generated"]
    assert header["inputs_sha256"] == rendered.inputs_sha256 and header["generator"] == "gen-programs, generator/"


def test_inputs_hash_covers_generator_and_templates():
    files = render.input_files(ROOT)
    assert "generator/spec.py" in files and "templates/program.cu.j2" in files
    assert "templates/moe_finalize_allreduce.cuh.j2" in files
    assert all(not f.startswith("/") for f in files) and files == sorted(files)


def test_manifest_is_canonical_json(rendered, manifest):
    assert rendered.outputs["manifest.json"].decode() == manifest_mod.dumps(manifest)
    assert [p["name"] for p in manifest["programs"]] == sorted(p["name"] for p in manifest["programs"])


def test_manifest_contents(rendered, manifest):
    enumeration = rendered.enumeration
    assert [p["name"] for p in manifest["programs"]] == sorted(p.name for p in enumeration.programs)
    assert len(manifest["holes"]) == len(enumeration.holes)
    assert manifest["targets"] == list(spec.ARCH_TARGETS)
    assert manifest["param_plan"] == [[n, c, t] for n, c, t, _ in render.abi.PARAMS]
    assert manifest["tables"] == {f: f"tables/{f}.h" for f in spec.FAMILIES}
    for p in manifest["programs"]:
        cell = spec.parse(p["name"])
        assert (p["family"], p["dtype"], p["world_size"], p["profile"]) == (
            cell.family, cell.dtype, cell.world_size, cell.profile)
        assert p["protocol_class"] == cell.protocol_class and p["params"] == "param_plan"
        assert p["launch"]["cluster"] == 1 and "row_stages" in p["launch"]["dynamic_smem"]
        data = rendered.outputs[p["file"]]
        assert p["bytes"] == len(data) and p["sha256"] == verify.sha256_bytes(data)
    assert set(manifest["files"]) == {rel for rel, _ in rendered.outputs.items()} - {"manifest.json"}
    assert len(manifest["selection"]["boundaries"]) == len(spec.DTYPES) * len(spec.WORLD_SIZES) * len(
        spec.OUTPUT_PROFILES)


def test_register_bound_follows_the_cap(rendered, manifest):
    """Each program file carries the qualifier of its cap (spec.REGISTER_CAP), the manifest the cap,
    and a capped block of MAX_THREADS threads still fits the register file."""
    capped = 0
    for p in manifest["programs"]:
        cap = spec.register_cap(p["family"], p["world_size"], p["profile"])
        assert p["register_cap"] == cap
        text = rendered.outputs[p["file"]].decode()
        want = f"__maxnreg__({cap})" if cap else f"__launch_bounds__({render.abi.MAX_THREADS})"
        assert f'extern "C" __global__ void {want} {p["symbol"]}(' in text
        assert ("__maxnreg__" in text) == bool(cap) and ("__launch_bounds__" in text) != bool(cap)
        capped += bool(cap)
    assert capped == sum(1 for p in manifest["programs"]
                         if (spec.FAMILY_REGIME[p["family"]][0], p["world_size"]) in spec.REGISTER_CAP or p["row_stages"])
    # the one-shot and the pipelined two-shot with register loads pass their loads to the kernel
    # body; the pipelined two-shot with the ring passes its stages, under the ring's cap; no other
    # program passes either
    passing = ringed = 0
    for p in manifest["programs"]:
        loads = spec.loads_in_flight(p["family"], p["profile"])
        stages = spec.row_stages(p["family"], p["profile"])
        text = rendered.outputs[p["file"]].decode()
        assert p["row_stages"] == stages
        if stages:
            ringed += 1
            assert p["family"] == "twoshot_pipelined" and loads is None
            assert p["register_cap"] == spec.PIPELINED_RING_CAP
            assert (f"/*routes_in_flight=*/4, /*shared_row_first=*/false, /*row_stages=*/{stages}>(p);" in text)
            continue
        assert "row_stages" not in text
        if loads is None:
            assert p["family"] not in ("oneshot", "twoshot_pipelined", "twoshot_pipelined_loads")
            assert "routes_in_flight" not in text and "shared_row_first" not in text
            continue
        passing += 1
        if p["family"] == "twoshot_pipelined_loads":
            assert loads == spec.PIPELINED_LOADS[p["profile"]] and p["register_cap"] == 72
        else:
            assert p["family"] == "oneshot" and loads == spec.ONESHOT_LOADS and p["register_cap"] is None
        assert (f"/*routes_in_flight=*/{loads[0]}, /*shared_row_first=*/{str(loads[1]).lower()}>(p);"
                in text)
    assert passing + ringed == sum(p["family"] in ("oneshot", "twoshot_pipelined", "twoshot_pipelined_loads")
                                   for p in manifest["programs"])
    assert passing > 0 and ringed > 0
    too_many = spec.ProgramSpec("twoshot", "bf16", 2, "110")
    original = dict(spec.REGISTER_CAP)
    try:
        spec.REGISTER_CAP[("twoshot", 2)] = 129  # 129 x 512 threads > 65,536 registers
        with pytest.raises(ValueError, match="would not fit"):
            render.register_bound(too_many)
    finally:
        spec.REGISTER_CAP.clear()
        spec.REGISTER_CAP.update(original)


def test_outputs_refuse_a_path_twice():
    outputs = render.Outputs()
    outputs.add("tables/x.h", "a")
    with pytest.raises(ValueError, match="twice"):
        outputs.add("tables/x.h", "a")
    with pytest.raises(ValueError):
        outputs.add("../escape.h", "a")


def test_write_tree_writes_only_changes_and_removes_stale(rendered, tmp_path):
    dest = tmp_path / "generated"
    first = render.write_tree(rendered.outputs, dest)
    assert len(first.written) == len(rendered.outputs) and not first.removed
    (dest / "programs" / "moe_ar_gone_bf16_ws2_o110.cu").write_text("stale\n")
    (dest / "old").mkdir()
    (dest / "old" / "x.h").write_text("stale\n")
    mtime = (dest / "manifest.json").stat().st_mtime_ns
    second = render.write_tree(rendered.outputs, dest)
    assert not second.written and len(second.unchanged) == len(rendered.outputs)
    assert set(second.removed) == {"programs/moe_ar_gone_bf16_ws2_o110.cu", "old/x.h"}
    assert not (dest / "old").exists() and (dest / "manifest.json").stat().st_mtime_ns == mtime


def test_write_tree_refuses_a_foreign_folder(rendered, tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(render.GenerateError, match="refusing"):
        render.write_tree(rendered.outputs, tmp_path)
    assert (tmp_path / "notes.txt").exists()


def test_full_regeneration_is_fast(tmp_path):
    start = time.perf_counter()
    r = run_cli(["--out", str(tmp_path / "out")], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - start < 5.0
    assert re.match(r"\d+ programs, \d+ holes: \d+ files written, 0 unchanged, 0 removed \(\d+\.\d+ s\)$",
                    r.stdout.strip()), r.stdout


# ---- the emitted C++ tables ---------------------------------------------------------

_ENTRY_RE = re.compile(r'^\s*(?:"(?P<symbol>\w+)"|(?P<null>nullptr)),\s*// (?P<dtype>\w+) ws(?P<ws>\d+) '
                       r'(?P<tag>\w+)(?: hole -> (?P<fallback>\w+): (?P<reason>.+))?$')
_BOUNDS_RE = re.compile(r"^\s*\{(\d+), (\d+), (\d+|kAllTokens), (\d+|kAllTokens)\},\s*// (\w+) ws(\d+) (\w+): \S.*$")


def _cells():
    return list(itertools.product(spec.DTYPES, spec.WORLD_SIZES, spec.OUTPUT_PROFILES))


def test_cpp_tables_parse_back_to_the_manifest(rendered, manifest):
    programs = {(p["family"], p["dtype"], p["world_size"], p["profile"]): p["symbol"] for p in manifest["programs"]}
    holes = {(h["family"], h["dtype"], h["world_size"], h["profile"]): h for h in manifest["holes"]}
    dims = f"[{len(spec.DTYPES)}][{len(spec.WORLD_SIZES)}][{len(spec.OUTPUT_PROFILES)}]"
    for family, rel in manifest["tables"].items():
        text = rendered.outputs[rel].decode()
        assert f"static const char* const k{spec.FAMILY_CAMEL[family]}Kernels{dims} = {{" in text
        assert f"// [dtype: fp16, bf16][world size: 2, 4, 8][output profile: {', '.join(spec.OUTPUT_PROFILES)}]" in text
        entries = [m for m in map(_ENTRY_RE.match, text.splitlines()) if m]
        tag_to_profile = {spec.profile_tag(p): p for p in spec.OUTPUT_PROFILES}
        # one entry a line, in index order
        assert [(m["dtype"], int(m["ws"]), tag_to_profile[m["tag"]]) for m in entries] == _cells()
        for m in entries:
            key = (family, m["dtype"], int(m["ws"]), tag_to_profile[m["tag"]])
            if m["null"]:
                assert key in holes and key not in programs
                assert (m["fallback"], m["reason"]) == (holes[key]["fallback_family"], holes[key]["reason"])
            else:
                assert programs[key] == m["symbol"]
    assert len(programs) + len(holes) == len(spec.FAMILIES) * len(_cells())


def test_selection_table_parses_back_to_the_manifest(rendered, manifest):
    text = rendered.outputs[manifest["selection"]["table"]].decode()
    dims = f"[{len(spec.DTYPES)}][{len(spec.WORLD_SIZES)}][{len(spec.OUTPUT_PROFILES)}][4]"
    assert f"static const int kRegimeBoundaries{dims} = {{" in text
    assert f"constexpr int kAllTokens = {tuning.ALL_TOKENS};" in text
    tag_to_profile = {spec.profile_tag(p): p for p in spec.OUTPUT_PROFILES}
    rows = [(bounds, dtype, ws, tag_to_profile[tag]) for *bounds, dtype, ws, tag in
            (m.groups() for m in map(_BOUNDS_RE.match, text.splitlines()) if m)]
    assert [(dtype, int(ws), p) for _, dtype, ws, p in rows] == _cells()
    fields = ("oneshot_max_tokens", "early_max_tokens", "twoshot_max_tokens", "loads_max_tokens")
    expected = {(b["dtype"], b["world_size"], b["profile"]): tuple(b[f] for f in fields)
                for b in manifest["selection"]["boundaries"]}
    parsed = {(dtype, int(ws), p): tuple(tuning.ALL_TOKENS if x == "kAllTokens" else int(x) for x in bounds)
              for bounds, dtype, ws, p in rows}
    assert parsed == expected


# ---- the manifest verifier ----------------------------------------------------------

def test_verify_module_is_pure_stdlib():
    tree = ast.parse((ROOT / "generator" / "verify.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "verify.py must not import from its package"
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "hashlib", "json", "pathlib"}, imported


@pytest.fixture()
def generated_copy(rendered, tmp_path):
    dest = tmp_path / "generated"
    render.write_tree(rendered.outputs, dest)
    return dest


def test_verify_accepts_a_fresh_tree_and_inlines_the_body(generated_copy, manifest):
    loaded = verify.load_verified_manifest(generated_copy)
    name = loaded["programs"][0]["name"]
    source = verify.source_for(loaded, generated_copy, name)
    body = (generated_copy / loaded["body"]["file"]).read_text()
    assert '#include "moe_finalize_allreduce.cuh"' not in source
    assert body in source and f" {name}(" in source


def test_verify_refuses_a_tampered_file(generated_copy, manifest):
    rel = manifest["programs"][3]["file"]
    path = generated_copy / rel
    path.write_text(path.read_text().replace("moe_ar::", "moe_ar ::", 1))
    with pytest.raises(verify.ManifestError) as e:
        verify.load_verified_manifest(generated_copy)
    assert f"generated/{rel}" in str(e.value) and "run `gen-programs` to regenerate" in str(e.value)


@pytest.mark.parametrize("which", ["program", "body", "table"])
def test_verify_refuses_a_missing_file(generated_copy, manifest, which):
    rel = {"program": manifest["programs"][0]["file"], "body": manifest["body"]["file"],
           "table": manifest["tables"]["twoshot"]}[which]
    (generated_copy / rel).unlink()
    with pytest.raises(verify.ManifestError) as e:
        verify.load_verified_manifest(generated_copy)
    assert f"generated/{rel}: missing" in str(e.value) and "gen-programs" in str(e.value)


def test_source_for_rechecks_the_body(generated_copy, manifest):
    loaded = verify.load_verified_manifest(generated_copy)
    (generated_copy / loaded["body"]["file"]).write_text("// edited\n")
    with pytest.raises(verify.ManifestError, match="kernels/moe_finalize_allreduce.cuh"):
        verify.source_for(loaded, generated_copy, loaded["programs"][0]["name"])


def test_verify_refuses_a_missing_manifest(tmp_path):
    with pytest.raises(verify.ManifestError, match="manifest.json: missing; run `gen-programs`"):
        verify.load_verified_manifest(tmp_path)


# ---- the CLI ------------------------------------------------------------------------

def test_check_passes_on_the_committed_tree():
    r = run_cli(["--check"], cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "up to date" in r.stdout


def test_check_catches_a_tampered_and_a_stale_file(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    r = run_cli(["--check"], cwd=repo)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    table = repo / "generated" / "tables" / "twoshot.h"
    table.write_text(table.read_text().replace('"moe_ar_ts_bf16_ws4_o110"', "nullptr"))
    (repo / "generated" / "programs" / "moe_ar_ts_bf16_ws16_o110.cu").write_text("// old\n")
    r = run_cli(["--check"], cwd=repo)
    assert r.returncode == 1
    assert "--- generated/tables/twoshot.h" in r.stdout
    assert '-            nullptr,  // bf16 ws4 o110' in r.stdout
    assert '+            "moe_ar_ts_bf16_ws4_o110",  // bf16 ws4 o110' in r.stdout
    assert "programs/moe_ar_ts_bf16_ws16_o110.cu" in r.stdout
    assert "run `gen-programs` to regenerate" in r.stderr
    assert run_cli([], cwd=repo).returncode == 0
    assert run_cli(["--check"], cwd=repo).returncode == 0


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args], cwd=repo,
                   check=True, capture_output=True)


def test_diff_reports_changed_cells(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    assert run_cli([], cwd=repo).returncode == 0
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert r.returncode == 0 and r.stdout.strip() == "no changes", r.stdout + r.stderr

    policy_py = repo / "generator" / "policy.py"
    text = policy_py.read_text()
    assert "lambda s: s.world_size == 8)," in text
    policy_py.write_text(text.replace("lambda s: s.world_size == 8),",
                                      'lambda s: s.world_size == 8 and s.dtype == "bf16"),'))
    tuning_py = repo / "generator" / "tuning.py"
    text = tuning_py.read_text()
    tuning_py.write_text(text.replace("MODEL_ONESHOT_MAX_TOKENS = {2: 64, 4: 64,",
                                      "MODEL_ONESHOT_MAX_TOKENS = {2: 64, 4: 128,"))
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "+ twoshot_early_shared fp16 ws8 o110: appeared, moe_ar_tses_fp16_ws8_o110 (was a hole: " \
           "no early shared variant at world size 8 (the early range is short there))" in lines
    assert sum(line.startswith("+ twoshot_early_shared fp16 ws8") for line in lines) == len(spec.OUTPUT_PROFILES)
    assert "~ selection bf16 ws4 o111: oneshot_max_tokens 64 -> 128" in lines
    assert not any("program changed" in line or "vanished" in line for line in lines), lines

    policy_py.write_text(policy_py.read_text().replace('lambda s: s.world_size == 2),', 'lambda s: s.world_size <= 4),', 1))
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert any(line.startswith("- twoshot_shared bf16 ws4 o110: vanished, moe_ar_tss_bf16_ws4_o110 (now a hole -> "
                               "twoshot") for line in r.stdout.splitlines()), r.stdout


def test_diff_reports_a_changed_program_and_body(manifest):
    new = json.loads(json.dumps(manifest))
    new["programs"][0]["code_sha256"] = "0" * 64
    new["body"]["code_sha256"] = "1" * 64
    lines = diff_manifests(manifest, new)
    p = new["programs"][0]
    assert any(line.startswith(f"~ {p['family']} {p['dtype']} ws{p['world_size']} {spec.profile_tag(p['profile'])}: program changed")
               for line in lines)
    assert any(line.startswith("~ kernel body kernels/moe_finalize_allreduce.cuh changed") for line in lines)
    assert diff_manifests(manifest, manifest) == []


def test_diff_rejects_an_unknown_revision():
    r = run_cli(["diff", "no-such-revision-xyz"], cwd=ROOT)
    assert r.returncode != 0 and "not a git revision" in r.stderr


def test_list_filters():
    r = run_cli(["list", "--family", "twoshot_shared", "--dtype", "bf16", "--world-size", "4", "--profile", "110",
                 "--profile", "111"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].split() == ["name", "protocol", "class", "file"]
    assert [row.split()[0] for row in rows[1:]] == ["moe_ar_tss_bf16_ws4_o110", "moe_ar_tss_bf16_ws4_o111"]
    assert "lamport2_bf16_ws4" in rows[1] and "generated/programs/moe_ar_tss_bf16_ws4_o110.cu" in rows[1]


def test_tables_marks_holes_and_fallbacks():
    r = run_cli(["tables"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for family in spec.FAMILIES:
        assert f"{family}  (tables/{family}.h" in r.stdout
    assert "-- hole[1] -> twoshot_early" in r.stdout
    assert "no shared-expert prefetch at world size 2" in r.stdout
    assert "selection (tables/selection.h, source: cells measured in bench_results/" in r.stdout
    assert re.search(r"bf16 ws8 +16 / 2048 / all / all \(model\)", r.stdout), r.stdout
    assert "hole[1]: written for world size 2 (one peer)" in r.stdout  # the pipelined two-shot at 4 and 8
    assert re.search(r"bf16 ws2 +\d+ / \d+ / (\d+|all) / (\d+|all) +\d", r.stdout), r.stdout  # measured: no model mark
