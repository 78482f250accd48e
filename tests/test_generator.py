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
from generator import code_hash, diffing, policy, render, spec, table_sets, tuning
from generator.diffing import diff_manifests, manifest_at
from generator.enumeration import enumerate_programs
from moe_ar_common import manifest_reader

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
    for name in ("generator", "moe_ar_common", "templates", "kernels", "generated", "bench_results"):
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
    """Each family's space (its world sizes) x dtype x profile, less the holes; a hole falls back along
    its base chain to a family of the same protocol, within the same world sizes."""
    enumeration = enumerate_programs()
    product = [spec.ProgramSpec(family, dtype, world_size, profile) for family in spec.FAMILIES
               for dtype, world_size, profile in itertools.product(
                   spec.DTYPES, spec.world_sizes_of(family), spec.OUTPUT_PROFILES)]
    holes = {h.spec for h in enumeration.holes}
    assert holes == {c for c in product if policy.hole_reason(c)}
    assert list(enumeration.programs) == [c for c in product if c not in holes] == \
        [c for c in spec.all_cells() if c not in holes]
    assert len(enumeration.programs) + len(enumeration.holes) == len(product)
    for hole in enumeration.holes:
        assert hole.reason == policy.hole_reason(hole.spec)
        fallback = spec.ProgramSpec(hole.fallback_family, hole.spec.dtype, hole.spec.world_size, hole.spec.profile)
        assert policy.is_supported(fallback)
        assert spec.FAMILY_BY_NAME[hole.fallback_family].protocol == spec.FAMILY_BY_NAME[hole.spec.family].protocol


def test_world_size_one_and_the_exchanges_are_two_spaces(manifest):
    """World size 1 exchanges nothing: the local families have programs there only, the exchange
    families at the others only. A cell across that line is no hole (no program could stand there, and
    none is a ProgramSpec); the holes are cells where a program could exist and does not, each with
    its reason, and selection's world-size-1 rule is the manifest's selection.no_peers."""
    local = [f for f in spec.FAMILIES if not spec.exchanges(f)]
    assert local == ["local", "local_streaming"]
    for family in spec.FAMILIES:
        mine = spec.world_sizes_of(family)
        assert mine == ((spec.LOCAL_WORLD_SIZE,) if family in local else spec.EXCHANGE_WORLD_SIZES)
        for world_size in set(spec.WORLD_SIZES) - set(mine):
            with pytest.raises(ValueError, match="outside family"):
                spec.ProgramSpec(family, "bf16", world_size, "plain")
            with pytest.raises(ValueError):
                spec.parse(f"moe_ar_{family}_bf16_ws{world_size}_plain")
    for family in manifest["axes"]["families"]:
        assert family["world_sizes"] == list(spec.world_sizes_of(family["name"]))
    for hole in manifest["holes"]:
        assert hole["world_size"] in spec.world_sizes_of(hole["family"]) and hole["reason"], hole
        assert hole["world_size"] in spec.world_sizes_of(hole["fallback_family"]), hole
    assert manifest["selection"]["no_peers"] == {"world_size": 1, "family": "local"}
    # 84 holes against 156 programs, every one a variant missing where its base runs
    assert (len(manifest["programs"]), len(manifest["holes"])) == (156, 84)
    assert {h["family"] for h in manifest["holes"]} == {"twoshot_shared", "twoshot_early_shared", "twoshot_pipelined",
                                                         "twoshot_pipelined_loads"}


def test_root_family_hole_is_refused():
    with pytest.raises(ValueError, match="root family"):
        enumerate_programs(is_supported=lambda s: s.family != "twoshot", hole_reason=lambda s: "test")


@pytest.mark.parametrize("cell", list(spec.all_cells()), ids=lambda c: c.name)
def test_names_round_trip(cell):
    assert spec.parse(cell.name) == cell
    assert cell.symbol == cell.name and cell.file_name == f"programs/{cell.name}.cu"


@pytest.mark.parametrize("bad", ["moe_ar_xx_bf16_ws4_plain", "moe_ar_twoshot_bf32_ws4_plain", "moe_ar_twoshot_bf16_ws3_plain",
                                 "moe_ar_twoshot_bf16_ws4_o112", "moe_ar_twoshot_bf16_ws4_o110", "ts_bf16_ws4_o110",
                                 "moe_ar_twoshot_bf16_ws4_plain.cu", "moe_ar_twoshot_bf16_ws04_plain",
                                 "moe_ar_twoshot__bf16_ws4_plain", "moe_ar_ts_bf16_ws4_plain", "moe_ar_tses_bf16_ws4_plain"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        spec.parse(bad)


def test_program_names_spell_the_family_in_words(manifest):
    """A name reads without a decoder: moe_ar_<family>_<dtype>_ws<world size>_<profile>, every part
    by its name, none of them one of the family codes names had before (FAMILY_CODES_BEFORE_WORDS)."""
    codes = set(spec.FAMILY_CODES_BEFORE_WORDS)
    for cell in spec.all_cells():
        assert cell.name == f"moe_ar_{cell.family}_{cell.dtype}_ws{cell.world_size}_{cell.profile}"
        assert not codes & set(cell.name.split("_")), cell.name
    for entry in manifest["programs"]:
        for name in (entry["name"], entry["symbol"], entry["cluster_symbol"] or entry["name"], entry["file"]):
            assert not codes & set(re.split(r"[_/.]", name)), name
    assert all("code" not in family for family in manifest["axes"]["families"])


def test_the_code_form_of_a_name_is_read_only_from_measurements():
    """Measurement files keep the names they were measured under: parse_recorded reads the code form
    as the family it stood for; parse (what names programs) does not."""
    assert spec.FAMILY_CODES_BEFORE_WORDS == {
        "lc": "local", "lcs": "local_streaming", "os": "oneshot", "ts": "twoshot", "tse": "twoshot_early",
        "tss": "twoshot_shared", "tses": "twoshot_early_shared", "tsp": "twoshot_pipelined",
        "tspl": "twoshot_pipelined_loads"}
    for code, family in spec.FAMILY_CODES_BEFORE_WORDS.items():
        cell = spec.ProgramSpec(family, "bf16", 1 if not spec.exchanges(family) else 2, "nvfp4")
        old = f"moe_ar_{code}_bf16_ws{cell.world_size}_nvfp4"
        assert spec.parse_recorded(old) == cell == spec.parse_recorded(cell.name) == spec.parse(cell.name)
        with pytest.raises(ValueError):
            spec.parse(old)
    for bad in ("moe_ar_xx_bf16_ws2_plain", "moe_ar_os_bf16_ws3_plain", "nccl+torch", "auto"):
        with pytest.raises(ValueError):
            spec.parse_recorded(bad)


def test_family_records_are_consistent():
    """One record per family; everything else derives from the records."""
    families = spec.FAMILY_BY_NAME.values()
    assert spec.FAMILIES == tuple(f.name for f in families)
    assert len({f.title for f in families}) == len(spec.FAMILIES)
    for family in families:
        assert family.base in spec.FAMILY_BY_NAME and family.regime in spec.REGIME_BY_NAME
        assert spec.FAMILY_BY_NAME[family.base].protocol == family.protocol
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", family.name)
        assert spec.family_for(family.regime, family.shared_prefetch) == family.name
    # every rung of the ladder has a family of its own name, without the shared-expert prefetch
    for regime in spec.LADDER:
        assert spec.family_for(regime.name, False) == regime.name
        assert regime.work_unit in ("row", "slice", "column")
    assert [r.max_tokens_field for r in spec.LADDER] == [*spec.BOUNDARY_FIELDS, None]
    assert dict(spec.PROTOCOL) == {f.name: f.protocol for f in families}


def test_profile_records_are_consistent():
    """Adding an output profile is one record in spec.py (plus its math in the template); profiles
    are named by their quant= value, plain for None; every name derived from one parses back."""
    profiles = spec.PROFILE_BY_NAME.values()
    assert spec.OUTPUT_PROFILES == ("plain", "nvfp4", "fp8_group128", "fp8_tensor")
    assert [p.quant for p in profiles] == [None, "nvfp4", "fp8_group128", "fp8_tensor"]
    assert dict(spec.PROFILE_QUANT) == {p.name: p.quant for p in profiles}
    # program names spell the profile by its name
    assert spec.ProgramSpec("twoshot_shared", "bf16", 4, "nvfp4").name == "moe_ar_twoshot_shared_bf16_ws4_nvfp4"
    assert spec.ProgramSpec("oneshot", "bf16", 2, "plain").name == "moe_ar_oneshot_bf16_ws2_plain"
    # the pipelined two-shot with register loads is generated for the profiles with loads, a hole elsewhere
    for profile in profiles:
        cell = spec.ProgramSpec("twoshot_pipelined_loads", "bf16", 2, profile.name)
        assert policy.is_supported(cell) == (profile.pipelined_loads is not None), profile.name
    for cell in spec.all_cells():
        assert spec.parse(cell.name) == cell
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cell.symbol), cell.symbol  # a C identifier
    with pytest.raises(ValueError, match="profile: unknown '110'"):
        spec.ProgramSpec("twoshot", "bf16", 2, "110")


def test_every_set_covers_every_cell():
    sets = table_sets.table_sets()
    assert [s.name for s in sets] == [d.name for d in table_sets.COMMITTED_SETS] + [table_sets.MODEL_NAME]
    cells = set(itertools.product(spec.DTYPES, spec.WORLD_SIZES, spec.OUTPUT_PROFILES))
    for table_set in sets:
        assert set(table_set.boundaries) == cells, table_set.name
    h200, model = sets[0], sets[-1]
    assert h200.name == "h200_nvlink" and h200.match == {"product": "NVIDIA H200", "capability": "9.0",
                                                        "interconnect": "nvlink"}
    assert model.match is None and all(b == tuning.model(w) for (_, w, _), b in model.boundaries.items())
    # World size 8 has no machine here: the written model, and the table says so.
    assert h200.boundaries[("bf16", 8, "nvfp4")] == tuning.Boundaries(
        (0, 0, tuning.MODEL_ONESHOT_MAX_TOKENS[8], tuning.MODEL_EARLY_MAX_TOKENS[8], tuning.ALL_TOKENS,
         tuning.ALL_TOKENS),
        tuning.MODEL_SOURCE)
    # World size 2 was measured (bench_results/), in bytes per rank, and fp16 borrows the bf16 measurement.
    measured = h200.boundaries[("bf16", 2, "plain")]
    assert measured.source.startswith(f"measured in {table_sets.COMMITTED_SETS[0].files[0]}: ")
    assert measured.key == "bytes_per_rank" and measured.measured == (1 * 4096 * 2, 16384 * 7168 * 2)
    assert h200.boundaries[("fp16", 2, "plain")].source.startswith("measured (bf16 data) in ")
    assert h200.boundaries[("bf16", 8, "nvfp4")].by_field() == {
        "local_max_tokens": 0, "streaming_max_tokens": 0, "oneshot_max_tokens": 16, "early_max_tokens": 2048,
        "twoshot_max_tokens": tuning.ALL_TOKENS, "loads_max_tokens": tuning.ALL_TOKENS}
    # World size 1: local for every T (the written model), and no T for local anywhere else.
    for table_set in (h200, model):
        for (dtype, world_size, profile), cell in table_set.boundaries.items():
            if world_size == spec.LOCAL_WORLD_SIZE:
                assert cell.by_field()["streaming_max_tokens"] == tuning.ALL_TOKENS
            else:
                assert cell.by_field()["local_max_tokens"] == 0, (table_set.name, dtype, world_size, profile)


def test_boundaries_follow_the_ladder():
    cell = tuning.Boundaries((0, 0, 4, 8, 16, 32), "test")
    expected = {1: "oneshot", 4: "oneshot", 5: "twoshot_early", 8: "twoshot_early", 9: "twoshot", 16: "twoshot",
                17: "twoshot_pipelined_loads", 32: "twoshot_pipelined_loads", 33: "twoshot_pipelined"}
    assert {tokens: cell.family(tokens) for tokens in expected} == expected
    with pytest.raises(ValueError, match="limits"):
        tuning.Boundaries((4, 8, 16), "test")
    with pytest.raises(ValueError, match="limits"):
        tuning.Boundaries((4, 8, 6, 32), "test")
    world_one = tuning.Boundaries(tuning.MODEL_WORLD_ONE, "test")
    assert {world_one.family(tokens) for tokens in (1, 2, tuning.MODEL_LOCAL_MAX_TOKENS)} == {"local"}
    assert {world_one.family(tokens) for tokens in (tuning.MODEL_LOCAL_MAX_TOKENS + 1, 2**20, tuning.ALL_TOKENS)} == \
        {"local_streaming"}


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
    """Every rendered file says it is generated, from which template, and how to regenerate it; the
    hand-written kernel headers are their sources byte for byte; only the manifest carries the inputs
    hash."""
    copied = {f"{render.BODY_DIR}/{p.name}" for p in (ROOT / render.KERNEL_DIR).glob("*.cuh")}
    assert copied and render.BODY_ENTRY in copied and render.PARAMS_FILE not in copied
    for rel, data in rendered.outputs.items():
        text = data.decode("utf-8")
        assert str(ROOT) not in text and "/tmp" not in text and "/home" not in text, rel
        assert text.endswith("\n"), rel
        if rel in copied:
            assert data == (ROOT / render.KERNEL_DIR / rel.rsplit("/", 1)[1]).read_bytes(), rel
            assert rendered.inputs_sha256 not in text, rel
        elif rel.endswith((".cu", ".cuh", ".h")):
            first, second = text.splitlines()[:2]
            assert first.startswith("// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from "
                                    "templates/") and first.endswith(".j2."), rel
            assert second == "// To change it, edit the template or generator/ and run `gen-programs`.", rel
            assert rendered.inputs_sha256 not in text and "inputs sha256" not in text, rel
    header = json.loads(rendered.outputs["manifest.json"])["_generated"]
    assert header["inputs_sha256"] == rendered.inputs_sha256 and header["generator"] == "gen-programs, generator/"


def test_inputs_hash_covers_generator_and_templates():
    files = render.input_files(ROOT)
    assert "generator/spec.py" in files and "templates/program.cu.j2" in files
    assert "templates/params.cuh.j2" in files and "kernels/moe_finalize_allreduce.cuh" in files
    assert {f"kernels/{p.name}" for p in (ROOT / "kernels").glob("*.cuh")} <= set(files)
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
    assert "tables" not in manifest  # no per-family header: the programs and holes are the manifest's
    assert sorted(rel for rel in manifest["files"] if rel.startswith("tables/")) == sorted(
        s["table"] for s in manifest["selection"]["sets"])
    for p in manifest["programs"]:
        cell = spec.parse(p["name"])
        assert (p["family"], p["dtype"], p["world_size"], p["profile"]) == (
            cell.family, cell.dtype, cell.world_size, cell.profile)
        assert p["protocol_class"] == cell.protocol_class and p["params"] == "param_plan"
        assert p["launch"]["cluster"] == 1 and "row_stages" in p["launch"]["dynamic_smem"]
        data = rendered.outputs[p["file"]]
        assert p["bytes"] == len(data) and p["sha256"] == manifest_reader.sha256_bytes(data)
    assert set(manifest["files"]) == {rel for rel, _ in rendered.outputs.items()} - {"manifest.json"}
    sets = manifest["selection"]["sets"]
    assert [s["name"] for s in sets] == [d.name for d in table_sets.COMMITTED_SETS] + [table_sets.MODEL_NAME]
    assert [s["match"] is None for s in sets] == [False] * len(table_sets.COMMITTED_SETS) + [True]
    for s in sets:
        assert len(s["boundaries"]) == len(spec.DTYPES) * len(spec.WORLD_SIZES) * len(spec.OUTPUT_PROFILES)
        assert s["table"] == f"tables/selection_{s['name']}.h" and s["table"] in manifest["files"]
        assert all(set(b["limits"]) == set(spec.BOUNDARY_FIELDS) and b["key"] in manifest["selection"]["keys"]
                   for b in s["boundaries"])
    assert [source["file"] for source in sets[0]["sources"]] == list(table_sets.COMMITTED_SETS[0].files)
    assert sets[0]["sources"][0]["stamp"]["gpu"]["product"] == "NVIDIA H200"
    # the records and the ladder, as the runtime reads them
    assert [f["name"] for f in manifest["axes"]["families"]] == list(spec.FAMILIES)
    assert [p["name"] for p in manifest["axes"]["output_profiles"]] == list(spec.OUTPUT_PROFILES)
    assert {p["name"]: p["quant"] for p in manifest["axes"]["output_profiles"]} == dict(spec.PROFILE_QUANT)
    assert manifest["selection"]["ladder"] == [
        ["local", "local_max_tokens"], ["local_streaming", "streaming_max_tokens"], ["oneshot", "oneshot_max_tokens"], ["twoshot_early", "early_max_tokens"],
        ["twoshot", "twoshot_max_tokens"], ["twoshot_pipelined_loads", "loads_max_tokens"], ["twoshot_pipelined", None]]
    assert manifest["selection"]["all_tokens"] == tuning.ALL_TOKENS
    assert manifest["selection"]["rule"].startswith("T <= local_max_tokens: local; T <= streaming_max_tokens: "
                                                    "local_streaming; T <= oneshot_max_tokens: oneshot; "
                                                    "T <= early_max_tokens: twoshot_early; T <= twoshot_max_tokens: "
                                                    "twoshot; ")
    # world size 1: the local programs only, every profile and dtype, and no local program elsewhere
    world_one = {(p["dtype"], p["profile"]) for p in manifest["programs"] if p["world_size"] == 1}
    assert world_one == set(itertools.product(spec.DTYPES, spec.OUTPUT_PROFILES))
    assert {p["family"] for p in manifest["programs"] if p["world_size"] == 1} == {"local", "local_streaming"}
    assert all(p["world_size"] == 1 for p in manifest["programs"] if p["family"].startswith("local"))
    assert {p["protocol_class"] for p in manifest["programs"] if p["world_size"] == 1} == {
        f"local_{dtype}_ws1" for dtype in spec.DTYPES}


def test_register_bound_follows_the_cap(rendered, manifest):
    """Each program file carries the qualifier of its cap (spec.REGISTER_CAP), the manifest the cap,
    and a capped block of MAX_THREADS threads still fits the register file."""
    capped = 0
    for p in manifest["programs"]:
        cap = spec.register_cap(p["family"], p["world_size"], p["profile"])
        assert p["register_cap"] == cap
        text = rendered.outputs[p["file"]].decode()
        local = spec.FAMILY_BY_NAME[p["family"]].regime == "local"
        streaming = spec.FAMILY_BY_NAME[p["family"]].regime == "local_streaming"
        # world size 1's streaming program: its cap through a macro a shape build may override
        want = (render.STREAMING_BOUND if streaming else f"__maxnreg__({cap})" if cap else
                render.ONE_BLOCK_BOUND if local else f"__launch_bounds__({render.abi.MAX_THREADS})")
        assert f'extern "C" __global__ void {want} {p["symbol"]}(' in text
        assert ("__maxnreg__" in text) == bool(cap) and ("__launch_bounds__" in text) != bool(cap)
        assert (render.ONE_BLOCK_BOUND in text) == local and (render.one_block_bound_lines() in text) == local
        assert (render.STREAMING_BOUND in text) == streaming
        if streaming:
            assert render.streaming_bound_lines(spec.ProgramSpec(p["family"], p["dtype"], p["world_size"],
                                                                 p["profile"])) in text
            assert f"#define {render.STREAMING_BOUND} __maxnreg__({cap})\n" in text
        if p["cluster_symbol"]:  # the cluster kernel: one block a multiprocessor (spec.LOCAL_MIN_BLOCKS)
            assert local and (f'extern "C" __global__ void __launch_bounds__({render.abi.MAX_THREADS}, '
                              f'{spec.LOCAL_MIN_BLOCKS}) {p["cluster_symbol"]}(') in text
        capped += bool(cap)
    assert capped == sum(1 for p in manifest["programs"]
                         if (spec.FAMILY_BY_NAME[p["family"]].regime, p["world_size"]) in spec.REGISTER_CAP
                         or p["row_stages"] or p["family"] == "local_streaming")
    # world size 1's streaming program: two blocks a multiprocessor, register loads, every profile
    for p in manifest["programs"]:
        if p["family"] == "local_streaming":
            assert p["register_cap"] == spec.LOCAL_TWO_BLOCKS_CAP and p["row_stages"] == 0
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
            assert p["family"] not in ("local", "local_streaming", "oneshot", "twoshot_pipelined",
                                       "twoshot_pipelined_loads")
            assert "routes_in_flight" not in text and "shared_row_first" not in text
            continue
        passing += 1
        if p["family"] == "twoshot_pipelined_loads":
            assert loads == spec.PROFILE_BY_NAME[p["profile"]].pipelined_loads and p["register_cap"] == 72
        elif p["family"] == "local":
            assert loads == spec.LOCAL_LOADS and p["register_cap"] is None and p["world_size"] == 1
        elif p["family"] == "local_streaming":
            assert loads == (spec.LOCAL_BATCH_ROUTES, False) and p["register_cap"] == spec.LOCAL_TWO_BLOCKS_CAP
        else:
            assert p["family"] == "oneshot" and loads == spec.ONESHOT_LOADS and p["register_cap"] is None
        assert (f"/*routes_in_flight=*/{loads[0]}, /*shared_row_first=*/{str(loads[1]).lower()}>(p);"
                in text)
    assert passing + ringed == sum(p["family"] in ("local", "local_streaming", "oneshot", "twoshot_pipelined",
                                                   "twoshot_pipelined_loads") for p in manifest["programs"])
    assert passing > 0 and ringed > 0
    too_many = spec.ProgramSpec("twoshot", "bf16", 2, "plain")
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
    (dest / "programs" / "moe_ar_gone_bf16_ws2_plain.cu").write_text("stale\n")
    (dest / "old").mkdir()
    (dest / "old" / "x.h").write_text("stale\n")
    mtime = (dest / "manifest.json").stat().st_mtime_ns
    second = render.write_tree(rendered.outputs, dest)
    assert not second.written and len(second.unchanged) == len(rendered.outputs)
    assert set(second.removed) == {"programs/moe_ar_gone_bf16_ws2_plain.cu", "old/x.h"}
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


# ---- reviewable diffs: code_sha256 and what an input change rewrites -----------------

def test_code_hash_ignores_comments_and_layout_only():
    source = ('#include "x.h"  // the header\n'
              '#define TWICE(a) \\\n  ((a) + (a))\n'
              'int f(int a) { /* one\n two */ return 1\'000 + TWICE(a) - -a; }\n'
              'const char* s = "not // a comment /* nor this */"; char c = \'/\';\n')
    same = ('#include "x.h"\n#define TWICE(a) ((a) + (a))  /* a comment */\n'
            'int f(int a)\n{\n    return 1\'000 + TWICE(a) - -a;  // reflowed\n}\n'
            'const char* s = "not // a comment /* nor this */";\nchar c = \'/\';\n')
    assert code_hash.code_sha256(source) == code_hash.code_sha256(same)
    # a changed token, a changed string or char literal, a changed directive line: another hash
    for changed in (source.replace("1\'000", "1\'001"), source.replace("- -a", "--a"),
                    source.replace("nor this", "nor that"), source.replace("\'/\'", "\'*\'"),
                    source.replace("  ((a) + (a))", "\n  ((a) + (a))"), source.replace('"x.h"', '"y.h"')):
        assert code_hash.code_sha256(changed) != code_hash.code_sha256(source), changed
    # comment markers inside literals stay code
    assert code_hash.code_tokens('s = "a//b"; t = "/*"; u = \'"\'; // gone') == [
        "s", "=", '"a//b"', ";", "t", "=", '"/*"', ";", "u", "=", "\'\"\'", ";"]
    assert code_hash.code_tokens("a>>=b->c...d") == ["a", ">>=", "b", "->", "c", "...", "d"]
    # the boundary between two texts is part of the hash
    assert code_hash.code_sha256("int a;", "int b;") != code_hash.code_sha256("int a; int b;", "")
    with pytest.raises(ValueError, match="not closed"):
        code_hash.code_tokens("int a; /* open")


def test_code_sha256_of_the_committed_programs_ignores_their_comments(rendered, manifest):
    # every program includes the whole body, in the manifest's order (params.cuh's header is a comment)
    headers = [rendered.outputs[h["file"]].decode() for h in manifest["body"]["headers"]]
    assert manifest["body"]["code_sha256"] == code_hash.code_sha256(*headers)
    for entry in manifest["programs"][:5]:
        assert entry["code_sha256"] == code_hash.code_sha256(rendered.outputs[entry["file"]].decode(), *headers)


def test_the_body_is_every_kernel_header_in_include_order(rendered, manifest):
    body = manifest["body"]
    files = [h["file"] for h in body["headers"]]
    assert body["entry"] == render.BODY_ENTRY == files[0] and body["include_dir"] == render.BODY_DIR
    assert set(files) == {rel for rel, _ in rendered.outputs.items() if rel.startswith(render.BODY_DIR + "/")}
    assert {h["file"]: h["source"] for h in body["headers"]} == {
        **{f"{render.BODY_DIR}/{p.name}": f"{render.KERNEL_DIR}/{p.name}" for p in (ROOT / render.KERNEL_DIR).glob("*.cuh")},
        render.PARAMS_FILE: f"templates/{render.PARAMS_TEMPLATE}"}
    # the entry lists the others in the order they are inlined; each is a plain header
    entry_text = rendered.outputs[render.BODY_ENTRY].decode()
    listed = [manifest_reader.quoted_include(line) for line in entry_text.splitlines() if manifest_reader.quoted_include(line)]
    assert [f"{render.BODY_DIR}/{name}" for name in listed] == files[1:]
    for rel in files:
        text = rendered.outputs[rel].decode()
        assert manifest_reader.has_pragma_once(text) and "{{" not in text and "{%" not in text, rel


def _changed(before: render.Outputs, after: render.Outputs) -> set[str]:
    paths = {rel for rel, _ in before.items()} | {rel for rel, _ in after.items()}
    return {rel for rel in paths if (rel in before and before[rel]) != (rel in after and after[rel])}


def _edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize("header", ["lamport.cuh", "moe_finalize_allreduce.cuh"])
def test_a_comment_change_rewrites_at_most_the_manifest_and_the_body(rendered, manifest, tmp_path, header):
    """A comment-only (or whitespace-only) change of a body header rewrites its copy in generated/
    and the manifest, nothing else, and no code_sha256 moves; so does one of the params template
    (its rendered header); a generator .py change that renders the same text rewrites the manifest
    alone; a real code change moves the body's and every program's code_sha256."""
    repo = copy_repo(tmp_path / "repo")
    source = repo / render.KERNEL_DIR / header
    _edit(source, "#pragma once\n", "#pragma once\n// a comment added by the test\n\n")
    text = source.read_text()
    indented = next(line for line in text.splitlines() if line.startswith("#include"))
    source.write_text(text.replace(indented + "\n", indented + "  \n", 1))  # whitespace only
    params = repo / "templates" / render.PARAMS_TEMPLATE
    _edit(params, "struct Params {", "// a comment added by the test\nstruct Params {")
    commented = render.render_all(repo)
    assert _changed(rendered.outputs, commented.outputs) == {
        "manifest.json", f"{render.BODY_DIR}/{header}", render.PARAMS_FILE}
    new = json.loads(commented.outputs["manifest.json"])
    assert new["_generated"]["inputs_sha256"] != manifest["_generated"]["inputs_sha256"]
    assert new["body"]["code_sha256"] == manifest["body"]["code_sha256"]
    assert [p["code_sha256"] for p in new["programs"]] == [p["code_sha256"] for p in manifest["programs"]]
    assert diff_manifests(manifest, new) == []

    shutil.copy(ROOT / render.KERNEL_DIR / header, source)
    shutil.copy(ROOT / "templates" / render.PARAMS_TEMPLATE, params)
    _edit(repo / "generator" / "spec.py", "# ---- dtypes and world sizes", "# ---- dtypes and world sizes (edited)")
    assert _changed(rendered.outputs, render.render_all(repo).outputs) == {"manifest.json"}

    _edit(repo / render.KERNEL_DIR / "lamport.cuh", "kSentinelWord = 0x80008000u", "kSentinelWord = 0x80000000u")
    new = json.loads(render.render_all(repo).outputs["manifest.json"])
    assert new["body"]["code_sha256"] != manifest["body"]["code_sha256"]
    assert all(a["code_sha256"] != b["code_sha256"] for a, b in zip(manifest["programs"], new["programs"]))
    lines = diff_manifests(manifest, new)
    assert lines[0].startswith(f"~ kernels/lamport.cuh changed: {len(manifest['programs'])} programs ("), lines
    assert lines[-1] == f"summary: {len(manifest['programs'])} programs changed code", lines


def test_diff_recomputes_the_revisions_code_hashes_and_profile_names(tmp_path):
    """`gen-programs diff REV` hashes REV's files as today's generator does, so a manifest written
    with another definition of code_sha256 (or before profiles were named) shows no false change."""
    repo = copy_repo(tmp_path / "repo")
    old = json.loads((repo / "generated" / "manifest.json").read_text())
    old["format"] = 1
    for entry in [*old["programs"], old["body"]]:
        entry["code_sha256"] = "0" * 64  # another definition
    codes = {"plain": "110", "nvfp4": "111"}
    for entry in [*old["programs"], *old["holes"], *(b for s in old["selection"]["sets"] for b in s["boundaries"])]:
        entry["profile"] = codes.get(entry["profile"], entry["profile"])
    (repo / "generated" / "manifest.json").write_text(json.dumps(old))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    assert run_cli([], cwd=repo).returncode == 0
    at_rev = manifest_at("HEAD", repo)
    new = json.loads((repo / "generated" / "manifest.json").read_text())
    assert at_rev["body"]["code_sha256"] == new["body"]["code_sha256"]
    assert {p["profile"] for p in at_rev["programs"]} == set(spec.OUTPUT_PROFILES)
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert r.returncode == 0 and r.stdout.strip() == "no changes", r.stdout + r.stderr


def test_diff_shows_a_renamed_program_as_a_rename(tmp_path):
    """A revision whose programs had other names (the plain profile was spelled o110 in names) shows
    each such cell as renamed with the same code but the name, and nothing else; a renamed program
    whose code changed too shows both."""
    repo = copy_repo(tmp_path / "repo")
    gen = repo / "generated"
    old = json.loads((gen / "manifest.json").read_text())
    renamed = 0
    for entry in old["programs"]:
        if entry["profile"] != "plain":
            continue
        before = entry["name"].removesuffix("_plain") + "_o110"
        text = (gen / entry["file"]).read_text().replace(entry["name"], before)
        if entry["name"] == "moe_ar_oneshot_bf16_ws2_plain":
            text = text.replace("/*shared_prefetch=*/false", "/*shared_prefetch=*/true")  # a code change too
        (gen / entry["file"]).unlink()
        entry["file"] = f"programs/{before}.cu"
        (gen / entry["file"]).write_text(text)
        entry["name"] = entry["symbol"] = before
        renamed += 1
    (gen / "manifest.json").write_text(json.dumps(old))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "old names")
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 1 and len(lines) == renamed + 1, r.stdout + r.stderr
    assert lines[-1] == f"summary: {renamed} programs renamed", lines
    assert "~ oneshot bf16 ws2 plain: renamed moe_ar_oneshot_bf16_ws2_o110 -> moe_ar_oneshot_bf16_ws2_plain, code sha256 " \
        in r.stdout, r.stdout
    same = [line for line in lines if line.endswith(", same code but the name")]
    assert len(same) == renamed - 1, r.stdout
    assert "~ twoshot fp16 ws8 plain: renamed moe_ar_twoshot_fp16_ws8_o110 -> moe_ar_twoshot_fp16_ws8_plain, same code but " \
           "the name" in lines, r.stdout


def test_diff_names_holes_that_left_the_tables_without_a_program(manifest):
    """A revision whose grid had cells across the world-size-1 line (holes of no program, and no
    no_peers rule) shows those holes as gone, grouped by family, and the rule as new; no cell of a
    program changes."""
    import copy
    old = copy.deepcopy(manifest)
    del old["selection"]["no_peers"]
    for family in ("oneshot", "local"):
        for world_size in ((1,) if family == "oneshot" else (2, 4)):
            old["holes"].append({"family": family, "dtype": "bf16", "world_size": world_size, "profile": "plain",
                                 "reason": "across the line", "fallback_family": None})
    lines = diff_manifests(old, manifest)
    assert lines == ["- local: 2 holes gone at world sizes 2/4 (no longer cells of the family)",
                     "- oneshot: 1 hole gone at world size 1 (no longer cells of the family)",
                     "~ selection without peers: absent -> world size 1 runs local for every exchange rung",
                     "summary: 3 holes gone, 1 table-wide change"], lines
    assert diff_manifests(manifest, old)[:2] == [
        "+ local: 2 holes added at world sizes 2/4 (new cells of the family)",
        "+ oneshot: 1 hole added at world size 1 (new cells of the family)"]


def test_diff_reads_a_revision_with_the_body_in_one_file(tmp_path):
    """A revision of manifest format 2 had the body in one file: `diff` hashes its programs as that
    layout compiles them (the program and the body), and says that the layouts differ instead of
    calling every program changed."""
    repo = copy_repo(tmp_path / "repo")
    gen = repo / "generated"
    current = json.loads((gen / "manifest.json").read_text())
    body_text = manifest_reader.body_source(current, gen)
    for header in current["body"]["headers"]:
        (gen / header["file"]).unlink()
    (gen / "kernels" / "moe_finalize_allreduce.cuh").write_text(body_text)
    old = dict(current, format=2, body={"file": "kernels/moe_finalize_allreduce.cuh", "code_sha256": "0" * 64,
                                        "sha256": manifest_reader.sha256_bytes(body_text.encode()), "bytes": len(body_text)})
    (gen / "manifest.json").write_text(json.dumps(old))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one body file")
    at_rev = manifest_at("HEAD", repo)
    assert at_rev["body"]["code_sha256"] == code_hash.code_sha256(body_text)
    for entry in at_rev["programs"][:3]:
        program = (gen / entry["file"]).read_text()
        assert entry["code_sha256"] == code_hash.code_sha256(program, body_text)
    assert run_cli([], cwd=repo).returncode == 0  # today's layout
    r = run_cli(["diff", "HEAD"], cwd=repo)
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and len(lines) == 2 and lines[1] == "summary: 1 table-wide change", r.stdout + r.stderr
    assert lines[0].startswith("~ kernel body layout changed: 1 file (kernels/moe_finalize_allreduce.cuh) -> "
                               f"{len(current['body']['headers'])} files (kernels/moe_finalize_allreduce.cuh, "
                               "kernels/params.cuh, "), lines
    assert "code changes of programs present in both cannot be told" in lines[0]


# ---- the emitted C++ tables ---------------------------------------------------------

def _bounds_re(fields: int) -> re.Pattern:
    return re.compile(r"^\s*\{(kTokens|kBytesPerRank), (\d+), (\d+), \{" + ", ".join([r"(\d+|kAllTokens)"] * fields)
                      + r"\}\},\s*// (\w+) ws(\d+) (\w+): (\S.*)$")


def _own_re(indexes: int, fields: int) -> re.Pattern:
    return re.compile(r"^\s*\{" + ", ".join([r"(\d+)"] * (indexes + 3)) + r", \{"
                      + ", ".join([r"(\d+|kAllTokens)"] * fields) + r"\}\},\s*// (\w+) ws(\d+) (\w+) at hidden (\d+)$")


def _with_own_rows(table_set):
    """The set with boundaries of their own at hidden 4096 in a world-size-1 and a world-size-2 cell."""
    import dataclasses
    cells = dict(table_set.boundaries)
    for cell, own in ((("bf16", 1, "plain"), (256, 4096) + (tuning.ALL_TOKENS,) * 4),
                      (("fp16", 2, "nvfp4"), (0, 0, 1 << 22, 1 << 22, 1 << 22, 1 << 23))):
        cells[cell] = dataclasses.replace(cells[cell], by_hidden=((4096, own, (8192, 1 << 27)),))
    return dataclasses.replace(table_set, boundaries=cells)


@pytest.mark.parametrize("own_rows", [False, True], ids=["committed", "with_own_rows"])
def test_selection_tables_parse_back_to_the_manifest(own_rows):
    """Every set's header holds each cell's key, measured range, source and the boundaries of the rungs
    that run there, as the manifest does: world size 1's grid the local rungs', the exchange world
    sizes' grid the exchange rungs' (the local ones are 0 there); the hidden sizes' own rows alike."""
    keys = {"kTokens": "tokens", "kBytesPerRank": "bytes_per_rank"}
    env = render.make_environment(ROOT)
    for table_set in table_sets.table_sets(ROOT):
        table_set = _with_own_rows(table_set) if own_rows else table_set
        text = env.get_template(render.SELECTION_TEMPLATE).render(**render._selection_context(table_set))
        row = manifest_mod.selection_set(table_set)
        assert f"constexpr int kAllTokens = {tuning.ALL_TOKENS};" in text
        for source in row["sources"]:
            assert f"// Measured in {source['file']}: " in text
        head, exchange_text = text.split("static const ExchangeBoundaries ", 1)
        local_text = head.split("static const LocalBoundaries ", 1)[1]
        for local, part in ((True, local_text), (False, exchange_text)):
            fields = spec.BOUNDARY_FIELDS[:spec.LOCAL_RUNGS] if local else spec.BOUNDARY_FIELDS[spec.LOCAL_RUNGS:]
            world_sizes = (1,) if local else spec.EXCHANGE_WORLD_SIZES
            dims = f"[{len(spec.DTYPES)}]" + ("" if local else f"[{len(world_sizes)}]") + f"[{len(spec.OUTPUT_PROFILES)}]"
            assert part.startswith(f"k{'Local' if local else 'Exchange'}Boundaries{dims} = {{")
            rows = [m.groups() for m in map(_bounds_re(len(fields)).match, part.splitlines()) if m]
            assert [(dtype, int(ws), p) for *_, dtype, ws, p, _source in rows] == list(
                itertools.product(spec.DTYPES, world_sizes, spec.OUTPUT_PROFILES))
            expected = {(b["dtype"], b["world_size"], b["profile"]):
                        (b["key"], tuple(b["measured"] or (0, 0)), tuple(b["limits"][f] for f in fields), b["source"])
                        for b in row["boundaries"] if b["world_size"] in world_sizes}
            parsed = {(dtype, int(ws), p): (keys[key], (int(low), int(high)),
                                            tuple(tuning.ALL_TOKENS if x == "kAllTokens" else int(x) for x in bounds),
                                            source)
                      for key, low, high, *bounds, dtype, ws, p, source in rows}
            assert parsed == expected, table_set.name
            own = {(b["dtype"], b["world_size"], b["profile"], int(hidden)):
                   (tuple(r["measured"]), tuple(r["limits"][f] for f in fields))
                   for b in row["boundaries"] if b["world_size"] in world_sizes
                   for hidden, r in b.get("by_hidden", {}).items()}
            parsed_own = {}
            k = 2 if local else 3  # indexes: dtype, (world,) profile
            for groups in (m.groups() for m in map(_own_re(k, len(fields)).match, part.splitlines()) if m):
                hidden, low, high = groups[k:k + 3]
                bounds, (dtype, ws, profile, comment_hidden) = groups[k + 3:-4], groups[-4:]
                d, *w, p = (int(i) for i in groups[:k])
                cell = (spec.DTYPES[d], world_sizes[w[0]] if w else 1, spec.OUTPUT_PROFILES[p])
                assert cell == (dtype, int(ws), profile) and hidden == comment_hidden
                parsed_own[(*cell, int(hidden))] = ((int(low), int(high)), tuple(
                    tuning.ALL_TOKENS if x == "kAllTokens" else int(x) for x in bounds))
            assert parsed_own == own, table_set.name
            assert own or not own_rows  # the injected rows are there (the committed set may have its own)
        for b in row["boundaries"]:  # what the exchange grid leaves out: the local rungs serve no T with peers
            if b["world_size"] != 1:
                assert all(b["limits"][f] == 0 for f in spec.BOUNDARY_FIELDS[:spec.LOCAL_RUNGS]), b


def test_a_local_rung_with_a_range_at_an_exchange_world_size_is_refused():
    """The exchange grid leaves out the local rungs' boundaries, so they must serve no T there."""
    import dataclasses
    table_set = table_sets.table_sets(ROOT)[-1]
    cells = dict(table_set.boundaries)
    cell = cells[("bf16", 4, "plain")]
    cells[("bf16", 4, "plain")] = dataclasses.replace(cell, limits=(1, 1, *cell.limits[2:]))
    with pytest.raises(render.GenerateError, match="model, bf16 ws4 plain: a local rung has a range with peers"):
        render._selection_context(dataclasses.replace(table_set, boundaries=cells))


# ---- the manifest verifier ----------------------------------------------------------

def test_manifest_reader_is_pure_stdlib():
    tree = ast.parse((ROOT / "moe_ar_common" / "manifest_reader.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "manifest_reader.py must not import from its package"
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "hashlib", "json", "pathlib"}, imported


@pytest.fixture()
def generated_copy(rendered, tmp_path):
    dest = tmp_path / "generated"
    render.write_tree(rendered.outputs, dest)
    return dest


def test_verify_accepts_a_fresh_tree_and_inlines_the_body(generated_copy, manifest):
    loaded = manifest_reader.load_verified_manifest(generated_copy)
    name = loaded["programs"][0]["name"]
    source = manifest_reader.source_for(loaded, generated_copy, name)
    assert not any(manifest_reader.quoted_include(line) for line in source.splitlines())
    assert f" {name}(" in source and source.startswith((generated_copy / loaded["programs"][0]["file"]).read_text()
                                                       .split('#include "', 1)[0])
    # every header once, in the manifest's order, each line of it kept but its includes
    headers = [h["file"] for h in loaded["body"]["headers"]]
    assert source.count("#pragma once") == len(headers)
    at = [source.index("".join(line for line in (generated_copy / rel).read_text().splitlines(keepends=True)
                               if not manifest_reader.quoted_include(line))) for rel in headers]
    assert at == sorted(at)
    body = manifest_reader.body_source(loaded, generated_copy)
    assert body in source and source.count("namespace moe_ar {") == body.count("namespace moe_ar {") > 1


def _tree(tmp_path, files: dict[str, str]) -> tuple[dict, pathlib.Path]:
    """A generated/ tree with one program prog.cu and the given body headers (kernels/<name>)."""
    gen = tmp_path / "gen"
    entries = {}
    for rel, text in {"programs/prog.cu": files.pop("programs/prog.cu"),
                      **{f"kernels/{n}": t for n, t in files.items()}}.items():
        (gen / rel).parent.mkdir(parents=True, exist_ok=True)
        (gen / rel).write_text(text)
        entries[rel] = {"file": rel, "sha256": manifest_reader.sha256_bytes(text.encode()), "bytes": len(text.encode())}
    manifest = {"format": manifest_reader.FORMAT, "files": {rel: {k: e[k] for k in ("sha256", "bytes")} for rel, e in entries.items()},
                "programs": [{**entries["programs/prog.cu"], "name": "prog"}],
                "body": {"entry": "kernels/a.h", "include_dir": "kernels",
                         "headers": [e for rel, e in entries.items() if rel.startswith("kernels/")]}}
    return manifest, gen


def test_source_for_inlines_as_the_preprocessor_includes(tmp_path):
    """#pragma once headers once (at their first include), headers without it at every include,
    recursively; a trailing comment on the include line; #include <...> stays."""
    manifest, gen = _tree(tmp_path, {
        "programs/prog.cu": '#include "a.h"  // the body\n#include "b.h"\nint main_;\n',
        "a.h": '#pragma once\n#include <cuda_fp16.h>\n#include "b.h"\n#include "c.h"\n#include "c.h"\nint a;\n',
        "b.h": "#pragma once\n#include \"a.h\"\nint b;",  # no newline at the end
        "c.h": "#ifndef C\n#define C\nint c;\n#endif\n"})
    source = manifest_reader.source_for(manifest, gen, "prog")
    assert source == ("#pragma once\n#include <cuda_fp16.h>\n#pragma once\nint b;\n"
                      "#ifndef C\n#define C\nint c;\n#endif\n#ifndef C\n#define C\nint c;\n#endif\nint a;\nint main_;\n")
    assert manifest_reader.inline_includes('#include "a.h"\n', "x", "kernels",
                                  lambda rel, _: (gen / rel).read_text())[1] == ["kernels/a.h", "kernels/b.h", "kernels/c.h"]


def test_source_for_refuses_an_unlisted_include_a_cycle_and_a_tampered_header(tmp_path):
    manifest, gen = _tree(tmp_path, {"programs/prog.cu": '#include "a.h"\n', "a.h": '#include "d.h"\n'})
    with pytest.raises(manifest_reader.ManifestError, match=r"generated/kernels/a.h: includes 'd.h', which is not a body header"):
        manifest_reader.source_for(manifest, gen, "prog")
    manifest, gen = _tree(tmp_path / "2", {"programs/prog.cu": '#include "a.h"\n', "a.h": '#include "b.h"\n',
                                           "b.h": '#include "a.h"\n'})
    with pytest.raises(manifest_reader.ManifestError, match=r"includes 'a.h' within itself \(programs/prog.cu -> kernels/a.h "
                                                   r"-> kernels/b.h -> kernels/a.h\)"):
        manifest_reader.source_for(manifest, gen, "prog")
    manifest, gen = _tree(tmp_path / "3", {"programs/prog.cu": '#include "a.h"\n', "a.h": "#pragma once\n"})
    (gen / "kernels" / "a.h").write_text("#pragma once\nint x;\n")
    with pytest.raises(manifest_reader.ManifestError, match="generated/kernels/a.h: does not match"):
        manifest_reader.source_for(manifest, gen, "prog")


def test_verify_refuses_a_tampered_file(generated_copy, manifest):
    rel = manifest["programs"][3]["file"]
    path = generated_copy / rel
    path.write_text(path.read_text().replace("moe_ar::", "moe_ar ::", 1))
    with pytest.raises(manifest_reader.ManifestError) as e:
        manifest_reader.load_verified_manifest(generated_copy)
    assert f"generated/{rel}" in str(e.value) and "run `gen-programs` to regenerate" in str(e.value)


@pytest.mark.parametrize("which", ["program", "body", "table"])
def test_verify_refuses_a_missing_file(generated_copy, manifest, which):
    rel = {"program": manifest["programs"][0]["file"], "body": manifest["body"]["headers"][-1]["file"],
           "table": manifest["selection"]["sets"][0]["table"]}[which]
    (generated_copy / rel).unlink()
    with pytest.raises(manifest_reader.ManifestError) as e:
        manifest_reader.load_verified_manifest(generated_copy)
    assert f"generated/{rel}: missing" in str(e.value) and "gen-programs" in str(e.value)


@pytest.mark.parametrize("header", ["kernels/moe_finalize_allreduce.cuh", "kernels/lamport.cuh", "kernels/params.cuh"])
def test_source_for_rechecks_the_body(generated_copy, manifest, header):
    loaded = manifest_reader.load_verified_manifest(generated_copy)
    (generated_copy / header).write_text("// edited\n")
    with pytest.raises(manifest_reader.ManifestError, match=f"generated/{header}: does not match"):
        manifest_reader.source_for(loaded, generated_copy, loaded["programs"][0]["name"])
    with pytest.raises(manifest_reader.ManifestError, match=f"generated/{header}: does not match"):
        manifest_reader.body_source(loaded, generated_copy)


def test_verify_refuses_a_missing_manifest(tmp_path):
    with pytest.raises(manifest_reader.ManifestError, match="manifest.json: missing; run `gen-programs`"):
        manifest_reader.load_verified_manifest(tmp_path)


# ---- the CLI ------------------------------------------------------------------------

def test_check_passes_on_the_committed_tree():
    r = run_cli(["--check"], cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert "up to date" in r.stdout


def test_check_catches_a_tampered_and_a_stale_file(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    r = run_cli(["--check"], cwd=repo)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    table = repo / "generated" / "tables" / "selection_model.h"
    cell = next(line for line in table.read_text().splitlines() if line.endswith("// bf16 ws4 plain: written model"))
    assert ", 1024, kAllTokens" in cell
    table.write_text(table.read_text().replace(cell, cell.replace(", 1024, kAllTokens", ", 1025, kAllTokens")))
    (repo / "generated" / "programs" / "moe_ar_twoshot_bf16_ws16_plain.cu").write_text("// old\n")
    r = run_cli(["--check"], cwd=repo)
    assert r.returncode == 1
    assert "--- generated/tables/selection_model.h" in r.stdout
    assert "-" + cell.replace(", 1024, kAllTokens", ", 1025, kAllTokens") in r.stdout.splitlines()
    assert "+" + cell in r.stdout.splitlines()
    assert "programs/moe_ar_twoshot_bf16_ws16_plain.cu" in r.stdout
    assert "run `gen-programs` to regenerate" in r.stderr
    assert run_cli([], cwd=repo).returncode == 0
    assert run_cli(["--check"], cwd=repo).returncode == 0


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args], cwd=repo,
                   check=True, capture_output=True)


def _with_own_row_at_5120(manifest):
    """A copy of the manifest whose h200_nvlink bf16 ws1 plain cell (no row of its own at hidden 5120
    committed) has a row of its own at hidden 5120 (the latency layout at every T, measured 8 KiB to
    128 MiB), as a fit can give (fit.py)."""
    import copy
    new = copy.deepcopy(manifest)
    table_set = next(s for s in new["selection"]["sets"] if s["name"] == "h200_nvlink")
    cell = next(b for b in table_set["boundaries"]
                if (b["dtype"], b["world_size"], b["profile"]) == ("bf16", 1, "plain"))
    assert "5120" not in cell.get("by_hidden", {})
    cell.setdefault("by_hidden", {})["5120"] = {"limits": {field: tuning.ALL_TOKENS for field in cell["limits"]},
                                                "measured": [8192, 134217728]}
    return new, table_set, cell


def test_diff_reports_a_hidden_sizes_own_boundaries(manifest):
    """A cell's row for one hidden size added, changed or dropped is a line of its own."""
    with_row, _, cell = _with_own_row_at_5120(manifest)
    label = f"selection h200_nvlink {cell['dtype']} ws{cell['world_size']} {cell['profile']} at hidden 5120"
    old, manifest = manifest, with_row
    lines = diff_manifests(old, manifest)
    assert f"~ {label}: none of its own -> all / all / all / all / all / all measured 8KiB to 128MiB" in lines, lines
    assert f"~ {label}: all / all / all / all / all / all measured 8KiB to 128MiB -> none of its own" in \
        diff_manifests(manifest, old)
    assert diff_manifests(manifest, manifest) == []


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
    assert "lambda s: s.world_size >= 8)," in text
    policy_py.write_text(text.replace("lambda s: s.world_size >= 8),",
                                      'lambda s: s.world_size >= 8 and not (s.world_size == 8 and s.dtype == "fp16")),'))
    tuning_py = repo / "generator" / "tuning.py"
    text = tuning_py.read_text()
    tuning_py.write_text(text.replace("MODEL_ONESHOT_MAX_TOKENS = {2: 64, 4: 64,",
                                      "MODEL_ONESHOT_MAX_TOKENS = {2: 64, 4: 128,"))
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert "+ twoshot_early_shared fp16 ws8 plain: appeared, moe_ar_twoshot_early_shared_fp16_ws8_plain (was a hole: " \
           "no early shared variant from world size 8 (the early range is short there))" in lines
    assert sum(line.startswith("+ twoshot_early_shared fp16 ws8") for line in lines) == len(spec.OUTPUT_PROFILES)
    assert "~ selection model bf16 ws4 nvfp4: oneshot_max_tokens 64 -> 128" in lines
    assert "~ selection h200_nvlink bf16 ws4 nvfp4: oneshot_max_tokens 64 -> 128" in lines  # a model cell of the set
    assert not any("program changed" in line or "vanished" in line for line in lines), lines

    policy_py.write_text(policy_py.read_text().replace('lambda s: s.world_size == 2),', 'lambda s: s.world_size <= 4),', 1))
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert any(line.startswith("- twoshot_shared bf16 ws4 plain: vanished, moe_ar_twoshot_shared_bf16_ws4_plain (now a hole -> "
                               "twoshot") for line in r.stdout.splitlines()), r.stdout


def _committed_copy(dest):
    repo = copy_repo(dest)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    return repo


def test_diff_says_a_stale_generated_tree_is_stale(tmp_path):
    """Inputs changed but not rendered: `diff` would compare the old tree with itself and say "no
    changes"; it says generated/ is stale and what to run, with exit status 2."""
    repo = _committed_copy(tmp_path / "repo")
    _edit(repo / render.KERNEL_DIR / "lamport.cuh", "kSentinelWord = 0x80008000u", "kSentinelWord = 0x80000000u")
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert r.returncode == 2 and "no changes" not in r.stdout, r.stdout + r.stderr
    assert "generated/ is stale" in r.stderr and "run `gen-programs`" in r.stderr, r.stderr
    r = run_cli(["diff", "no-such-revision-xyz"], cwd=repo)
    assert r.returncode == 2 and "not a git revision" in r.stderr, r.stdout + r.stderr


def test_diff_groups_changed_programs_under_their_cause(tmp_path):
    """A kernel header's code change is one line naming the header and the programs it changed, not one
    line a program; a summary line closes the diff, and the exit status says there were changes (1);
    a comment change of a header changes no program's code (0, "no changes")."""
    repo = _committed_copy(tmp_path / "repo")
    n_programs = len(json.loads((repo / "generated" / "manifest.json").read_text())["programs"])
    _edit(repo / render.KERNEL_DIR / "lamport.cuh", "kSentinelWord = 0x80008000u",
          "kSentinelWord = 0x80008000u;  // a comment")
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    assert r.returncode == 0 and r.stdout.strip() == "no changes", r.stdout + r.stderr

    _edit(repo / render.KERNEL_DIR / "lamport.cuh", "kSentinelWord = 0x80008000u", "kSentinelWord = 0x80000000u")
    assert run_cli([], cwd=repo).returncode == 0
    r = run_cli(["diff", "HEAD"], cwd=repo)
    lines = r.stdout.splitlines()
    assert r.returncode == 1, r.stdout + r.stderr
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"~ kernels/lamport.cuh changed: {n_programs} programs (local 8, "), lines
    assert lines[1] == f"summary: {n_programs} programs changed code", lines

    _edit(repo / "templates" / "program.cu.j2", "{{ symbol }}(const moe_ar::Params p)",
          "{{ symbol }}(const moe_ar::Params params)")
    _edit(repo / "templates" / "program.cu.j2", "{% endif %}>(p);", "{% endif %}>(params);")  # every program's own text
    assert run_cli([], cwd=repo).returncode == 0
    lines = run_cli(["diff", "HEAD"], cwd=repo).stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(
        f"~ kernels/lamport.cuh and the program file (templates/program.cu.j2) changed: {n_programs} programs ("), lines


def test_diff_reports_a_changed_program_and_body(manifest):
    new = json.loads(json.dumps(manifest))
    new["programs"][0]["code_sha256"] = "0" * 64
    new["body"]["code_sha256"] = "1" * 64
    lines = diff_manifests(manifest, new)
    p = new["programs"][0]
    # the manifests alone do not tell the program's own file from the headers: no header's bytes changed
    assert lines == [f"~ {diffing.PROGRAM_FILE} changed: 1 program: {p['name']}", "summary: 1 program changed code"]
    assert diff_manifests(manifest, manifest) == []


def test_diff_rejects_an_unknown_revision():
    r = run_cli(["diff", "no-such-revision-xyz"], cwd=ROOT)
    assert r.returncode != 0 and "not a git revision" in r.stderr


def test_list_filters():
    r = run_cli(["list", "--family", "twoshot_shared", "--dtype", "bf16", "--world-size", "4", "--profile", "plain",
                 "--profile", "nvfp4"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].split() == ["name", "family", "profile", "protocol", "class", "file"]
    assert [row.split()[:3] for row in rows[1:]] == [["moe_ar_twoshot_shared_bf16_ws4_nvfp4", "twoshot_shared", "nvfp4"],
                                                     ["moe_ar_twoshot_shared_bf16_ws4_plain", "twoshot_shared", "plain"]]
    assert "lamport2_bf16_ws4" in rows[2] and "generated/programs/moe_ar_twoshot_shared_bf16_ws4_plain.cu" in rows[2]
    r = run_cli(["list", "--profile", "110"], cwd=ROOT)  # an old name code is not a profile's name
    assert r.returncode != 0 and "'110' is not one of 'plain', 'nvfp4'" in r.stderr, r.stderr


def test_tables_prints_a_hidden_sizes_own_boundaries(manifest, capsys):
    from generator import cli
    _, table_set, _ = _with_own_row_at_5120(manifest)
    local, exchange = spec.BOUNDARY_FIELDS[:spec.LOCAL_RUNGS], spec.BOUNDARY_FIELDS[spec.LOCAL_RUNGS:]
    fields = {(1,): list(local), spec.EXCHANGE_WORLD_SIZES: list(exchange)}
    profiles = [profile["name"] for profile in manifest["axes"]["output_profiles"]]
    cli._print_set(table_set, manifest["axes"], profiles, fields, manifest["selection"]["no_peers"])
    out = capsys.readouterr().out
    assert "  bf16 ws1 plain at hidden 5120: all / all (measured 8KiB to 128MiB)" in out, out
    assert out.index("  world size 1: ") < out.index("  bf16 ws1 plain at hidden 5120") < out.index("  world sizes 2,")


def test_tables_marks_holes_and_fallbacks():
    r = run_cli(["tables", "--width", "0"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    # how program names spell the families and profiles
    assert "program names: moe_ar_<family>_<dtype>_ws<world size>_<output profile>" in r.stdout
    assert re.search(r"^  twoshot_early_shared +two-shot, early, shared prefetch$", r.stdout, re.M), r.stdout
    assert re.search(r"^  plain +None$", r.stdout, re.M) and re.search(r"^  nvfp4 +nvfp4$", r.stdout, re.M)
    assert re.search(r"^ +plain +nvfp4 +fp8_group128 +fp8_tensor$", r.stdout, re.M)  # grid columns by name
    for family in spec.FAMILY_BY_NAME.values():
        assert f"{family.name}  (base {family.base}, protocol {family.protocol})" in r.stdout
    assert "-- hole[2] -> twoshot_early" in r.stdout
    assert "no shared-expert prefetch at world size 2" in r.stdout
    assert "set h200_nvlink (tables/selection_h200_nvlink.h): " in r.stdout
    assert "  for product 'NVIDIA H200', compute capability 9.0, interconnect nvlink" in r.stdout
    assert f"  measured in {table_sets.COMMITTED_SETS[0].files[0]}" in r.stdout
    assert "set model (tables/selection_model.h): the written model" in r.stdout
    assert re.search(r"^  bf16 ws8 +16 / 2048 / all / all \(model\)", r.stdout, re.M), r.stdout
    assert "hole[2]: written for world size 2 (one peer)" in r.stdout  # the pipelined two-shot at 4 and 8
    # measured, in bytes per rank: no model mark
    assert re.search(r"^  bf16 ws2 +\d+[KM]iB / \d+[KM]iB / (\d+[KM]iB|all) / (\d+[KM]iB|all) +\d", r.stdout, re.M), r.stdout
    # each set as two grids: world size 1 with the local rungs' boundaries, then the exchanges' with theirs
    local, exchange = spec.BOUNDARY_FIELDS[:spec.LOCAL_RUNGS], spec.BOUNDARY_FIELDS[spec.LOCAL_RUNGS:]
    assert r.stdout.count(f"  world size 1: {' / '.join(local)} (above: local again, no peers)\n") == 2
    assert r.stdout.count(f"  world sizes 2, 4, 8, 16: {' / '.join(exchange)}\n") == 2

    # two spaces: world size 1's local families, then the exchange families, no hole across the line
    world_one = ("== world size 1: nothing to exchange (local, local_streaming); every exchange rung of the ladder "
                 "runs local here")
    exchanges = "== world sizes 2, 4, 8, 16: the exchange families (oneshot, twoshot, "
    assert world_one in r.stdout and exchanges in r.stdout, r.stdout
    assert (r.stdout.index(world_one) < r.stdout.index("local  (") < r.stdout.index("local_streaming  (")
            < r.stdout.index(exchanges) < r.stdout.index("oneshot  ("))
    assert re.search(r"bf16 ws1 +moe_ar_local_bf16_ws1_plain +moe_ar_local_bf16_ws1_nvfp4 ", r.stdout), r.stdout
    assert not re.search(r"^  (fp16|bf16) ws1 +-- hole", r.stdout, re.M), r.stdout
    assert not re.search(r"^  (fp16|bf16) ws(2|4|8|16) +moe_ar_local", r.stdout, re.M), r.stdout
    assert "156 programs, 84 holes (a hole: a cell of a family's world sizes without a program)" in r.stdout
    assert re.search(r"^  bf16 ws1 +256 / all \(model\) +256 / all \(model\)", r.stdout, re.M), r.stdout


@pytest.mark.parametrize("width", [120, 80])
def test_tables_fit_the_width(width, manifest):
    """`tables` fits 120 columns (--width: another width): a grid too wide is cut into blocks of
    profile columns, each led by its row labels, and prose is wrapped; nothing is lost."""
    args = ["tables"] if width == 120 else ["tables", "--width", str(width)]
    r = run_cli(args, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    too_wide = [line for line in r.stdout.splitlines() if len(line) > width]
    assert not too_wide, too_wide
    for entry in manifest["programs"]:
        assert re.search(rf"\b{entry['name']}\b", r.stdout), entry["name"]
    words = run_cli(["tables", "--width", "0"], cwd=ROOT).stdout.split()  # one line a row, as wide as it takes
    assert sorted(set(words)) == sorted(set(r.stdout.split()))


def test_selection_map_draws_the_tables():
    """generated/selection_map.svg: at every token count the bar of each cell names the family the
    tables select there (holes fall back to their base), for every set, world size and profile."""
    from generator import selection_map
    enumeration = enumerate_programs()
    programs = {(p.family, p.dtype, p.world_size, p.profile) for p in enumeration.programs}
    checked = 0
    for table_set in table_sets.table_sets(ROOT):
        for (dtype, world_size, profile), bounds in table_set.boundaries.items():
            cell = (dtype, world_size, profile)
            tokens = selection_map.drawn_tokens(bounds)
            row = 1 if bounds.key == "tokens" else selection_map.DRAWN_HIDDEN * spec.DTYPE_BYTES[selection_map.DRAWN_DTYPE]
            segs = selection_map.segments(tokens, cell, programs)
            assert segs[0][0] == 1 and segs[-1][1] == 2 * selection_map.MAX_TOKENS_SHOWN - 1, segs
            assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(segs, segs[1:])), segs
            edges = {1, 2 * selection_map.MAX_TOKENS_SHOWN - 1} | {b + d for b in tokens for d in (0, 1)
                                                                    if b < selection_map.MAX_TOKENS_SHOWN}
            for T in sorted(T for T in edges | {2 ** i for i in range(15)} if T >= 1):  # a bound of 0: no T
                family = bounds.family(T * row, selection_map.DRAWN_HIDDEN)
                while (family, *cell) not in programs:
                    base = spec.FAMILY_BY_NAME[family].base
                    assert base != family, (table_set.name, cell, T, family)  # a hole with no base: fail, never spin
                    family = base
                drawn = next(f for first, last, f in segs if first <= T <= last)
                assert drawn == family, (table_set.name, cell, T, segs)
                checked += 1
    assert checked > 1000
    svg = (ROOT / "generated" / "selection_map.svg").read_text()
    assert svg.startswith("<!-- GENERATED FILE, DO NOT EDIT") and svg.rstrip().endswith("</svg>")
    for world_size in spec.WORLD_SIZES:
        assert f">world size {world_size}</text>" in svg
