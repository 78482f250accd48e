"""Packaging without building a wheel (.ci/wheel_check.sh builds and installs the real one): the
package data pyproject.toml ships, the lookups that find it installed, the declared dependencies,
the CUDA header discovery and the gen-programs behaviour a user without a repository or without a
CUDA extra meets. No GPU, no CUDA needed."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest
from click.testing import CliRunner

from dispatch import registry
from generator import cli, locations, render, spec, table_sets
from moe_ar_common import cuda_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI runs 3.11)


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- what the wheel ships ----------------------------------------------------------------

def _package_source(setuptools: dict, package: str) -> pathlib.Path:
    """The folder a package is built from: its package-dir mapping (or its parent's), else its dotted path."""
    mapping = setuptools.get("package-dir", {})
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in mapping:
            return ROOT / mapping[prefix] / pathlib.Path(*parts[n:])
    return ROOT / pathlib.Path(*parts)


def _shipped(setuptools: dict) -> dict[str, pathlib.Path]:
    """Installed path (under site-packages) -> source file, as setuptools lays the wheel out:
    every package's modules and the files its package-data globs match."""
    out = {}
    for package in setuptools["packages"]:
        src = _package_source(setuptools, package)
        dest = pathlib.PurePosixPath(*package.split("."))
        files = [p for p in src.glob("*.py")]
        for pattern in setuptools.get("package-data", {}).get(package, []):
            files += [p for p in src.glob(pattern) if p.is_file()]
        for p in files:
            out[(dest / p.relative_to(src).as_posix()).as_posix()] = p
    return out


def test_the_wheel_ships_every_file_the_runtime_and_the_generator_read(pyproject):
    setuptools = pyproject["tool"]["setuptools"]
    shipped = _shipped(setuptools)
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    for rel in [*manifest["files"], "manifest.json"]:
        assert f"moe_ar_data/generated/{rel}" in shipped, rel
    for template in (ROOT / "templates").iterdir():
        assert f"moe_ar_data/templates/{template.name}" in shipped, template.name
    for rel in table_sets.input_files(pathlib.Path(".")):  # the measurements of every committed table set
        assert f"moe_ar_data/{rel.as_posix()}" in shipped, rel
    # The code: every module of the three packages, and nothing of the source tree beside the data.
    for package in ("generator", "dispatch", "moe_ar_common"):
        for module in (ROOT / package).glob("*.py"):
            assert f"{package}/{module.name}" == shipped[f"{package}/{module.name}"].relative_to(ROOT).as_posix()
    assert not [k for k in shipped if k.startswith("moe_ar_data/generated/") and
                k.removeprefix("moe_ar_data/generated/") not in [*manifest["files"], "manifest.json"]]
    # The tools: every module, in every subpackage (bench, soak, reference, probes), at its own path.
    tools = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "moe_ar_tools").rglob("*.py"))
    assert "moe_ar_tools/bench/cli.py" in tools and "moe_ar_tools/reference/__init__.py" in tools
    for rel in tools:
        assert rel in shipped and shipped[rel].relative_to(ROOT).as_posix() == rel, rel


def test_the_wheel_ships_no_experiment(pyproject):
    # experiments/ (one-off probes and patches) is no package; of bench_results/ the wheel ships
    # only the measurements the committed table sets are fitted to.
    setuptools = pyproject["tool"]["setuptools"]
    assert not [p for p in setuptools["packages"] if p.split(".")[0] == "experiments"]
    sources = {src.relative_to(ROOT).as_posix() for src in _shipped(setuptools).values()}
    assert not [s for s in sources if s.startswith("experiments/") or s.endswith(".patch")]
    assert sorted(s for s in sources if s.startswith("bench_results/")) == \
        sorted(rel.as_posix() for rel in table_sets.input_files(pathlib.Path(".")))
    assert not [p for p in (ROOT / "bench_results").rglob("*") if p.suffix in (".py", ".patch", ".cu")]


def test_every_data_folder_is_a_listed_package(pyproject):
    # A data folder left out of `packages` is skipped by setuptools (or shipped with a warning).
    packages = set(pyproject["tool"]["setuptools"]["packages"])
    for sub in {pathlib.PurePosixPath(rel).parent for rel in
                json.loads((ROOT / "generated" / "manifest.json").read_text())["files"]}:
        name = "moe_ar_data.generated" + ("" if str(sub) == "." else "." + ".".join(sub.parts))
        assert name in packages, name


def _fake_site(tmp_path: pathlib.Path, pyproject: dict) -> pathlib.Path:
    """A site-packages laid out like the installed wheel, away from the checkout."""
    site = tmp_path / "site"
    for rel, src in _shipped(pyproject["tool"]["setuptools"]).items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, site / rel)
    return site


def test_installed_lookups_find_the_package_data(tmp_path, pyproject):
    """From a wheel's layout: the runtime finds generated/ and verifies it, the generator its
    templates, and rendering there gives the committed tree byte for byte."""
    site = _fake_site(tmp_path, pyproject)
    script = """
import json, pathlib, sys
from generator import locations, render
from dispatch import registry
site = pathlib.Path(sys.argv[1])
assert locations.checkout_root() is None
root = locations.installed_root()
assert root == site / "moe_ar_data", root
assert registry.GENERATED_DIR == root / "generated", registry.GENERATED_DIR
print(json.dumps({"programs": len(registry.program_set().by_name),
                  "env": render.make_environment(root).loader.searchpath,
                  "files": {rel: data.decode() for rel, data in render.render_all(root).outputs.items()}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-c", script, str(site)], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    assert out["programs"] == len(json.loads((ROOT / "generated" / "manifest.json").read_text())["programs"])
    assert out["env"] == [str(site / "moe_ar_data" / "templates")]
    committed = {p.relative_to(ROOT / "generated").as_posix(): p.read_text()
                 for p in (ROOT / "generated").rglob("*") if p.is_file()}
    assert out["files"] == committed


def test_a_checkout_reads_its_own_tree():
    # Code run from a checkout never pairs with another installation's files.
    assert locations.checkout_root() == ROOT
    assert locations.source_root() == ROOT
    assert registry.GENERATED_DIR == ROOT / "generated"
    assert registry._generated_dir() == ROOT / "generated"


def test_the_layout_marker_is_the_body_entry_header():
    assert locations._MARKER == (render.KERNEL_DIR, render.BODY_ENTRY.split("/")[-1])
    assert (ROOT / render.KERNEL_DIR / render.BODY_ENTRY.split("/")[-1]).is_file()


def test_the_generator_hashes_its_own_code():
    # Installed, the code is not under the data root: the inputs hash must find it all the same.
    files = render.input_files(ROOT)
    for package in ("generator", "moe_ar_common"):
        code = sorted(f"{package}/{p.name}" for p in (ROOT / package).glob("*.py"))
        assert code and [f for f in files if f.startswith(f"{package}/")] == code


# ---- dependencies -----------------------------------------------------------------------

def test_dependencies_are_declared_by_cuda_major(pyproject):
    project = pyproject["project"]
    names = lambda reqs: {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in reqs}
    assert names(project["dependencies"]) == {"jinja2", "click", "numpy", "torch"}
    extras = project["optional-dependencies"]
    assert names(extras["cu13"]) == {"cupy-cuda13x", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "cuda-bindings"}
    assert names(extras["cu12"]) == {"cupy-cuda12x", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12",
                                     "cuda-bindings"}
    assert names(extras["test"]) == {"pytest", "hypothesis", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm",
                                     "triton", "transformers", "matplotlib"}
    assert names(extras["examples"]) == {"transformers"}  # the model examples; never the runtime's
    # Each CUDA package of an extra is bounded to that major version.
    for major, extra in ((13, "cu13"), (12, "cu12")):
        for req in extras[extra]:
            if not req.startswith("cupy"):
                assert f"<{major + 1}" in req.replace(" ", ""), req


def test_what_the_runtime_imports_is_declared(pyproject):
    """Every third-party module the runtime (what `import dispatch` loads, moe_ar_common with it)
    imports, at its top or in a function, comes with the base dependencies or with each CUDA extra."""
    import dispatch  # noqa: F401
    imported = set()
    for name, module in list(sys.modules.items()):
        if name.startswith(("dispatch.", "moe_ar_common.")) and getattr(module, "__file__", None):
            for node in ast.walk(ast.parse(pathlib.Path(module.__file__).read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    imported.add(node.module.split(".")[0])
    top = imported - set(sys.stdlib_module_names) - {"dispatch", "moe_ar_common"}
    provides = {"torch": "torch", "numpy": "numpy", "cupy": "cupy-cuda{m}x", "cuda": "cuda-bindings",
                "nvidia": "nvidia-cuda-runtime"}
    assert "cupy" in top and "cuda" in top and top <= set(provides), top - set(provides)
    project = pyproject["project"]
    for major in (12, 13):
        declared = " ".join(project["dependencies"] + project["optional-dependencies"][f"cu{major}"])
        for module in top:
            assert provides[module].format(m=major) in declared, (module, major)


# ---- CUDA headers and NVRTC ---------------------------------------------------------------

def _headers(folder: pathlib.Path, version: int) -> pathlib.Path:
    folder.mkdir(parents=True)
    for name in cuda_env.REQUIRED_HEADERS:
        (folder / name).write_text("")
    (folder / "cuda.h").write_text(f"#pragma once\n#define CUDA_VERSION {version}\n")
    return folder


@pytest.fixture
def pip_headers(tmp_path, monkeypatch):
    """pip's two layouts side by side, and no toolkit: CUDA 13 in nvidia/cu13, CUDA 12 in nvidia/cuda_runtime."""
    nvidia = tmp_path / "nvidia"
    cu13 = _headers(nvidia / "cu13" / "include", 13050)
    cu12 = _headers(nvidia / "cuda_runtime" / "include", 12090)
    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(nvidia)]))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cuda_env, "TOOLKIT_DIRS", ())
    return cu13, cu12


def test_headers_follow_nvrtc_major(pip_headers, tmp_path, monkeypatch):
    cu13, cu12 = pip_headers
    assert cuda_env.include_dir(13) == str(cu13)
    assert cuda_env.include_dir(12) == str(cu12)
    assert cuda_env.include_dir() == str(cu13)  # unknown NVRTC: the newest
    assert cuda_env.header_major(str(cu12)) == 12
    # A toolkit named by CUDA_HOME comes after pip's headers, and serves a major they lack.
    toolkit = _headers(tmp_path / "cuda-11.8" / "include", 11080)
    monkeypatch.setenv("CUDA_HOME", str(toolkit.parent))
    assert cuda_env.include_dir(11) == str(toolkit)
    assert cuda_env.include_dir(12) == str(cu12)


def test_missing_headers_name_the_extra(pip_headers):
    cu13, cu12 = pip_headers
    shutil.rmtree(cu12.parent)
    with pytest.raises(cuda_env.MissingToolchain, match=r"CUDA 12 headers .*found only .*\(CUDA 13\).*pip install '\.\[cu12\]'"):
        cuda_env.include_dir(12)


def test_the_real_headers_match_the_installed_nvrtc():
    try:
        _nvrtc, version = cuda_env.load_nvrtc()
    except cuda_env.MissingToolchain:
        pytest.skip("no CUDA extra installed")
    assert cuda_env.header_major(cuda_env.include_dir(version[0])) == version[0]


@pytest.mark.parametrize("installed, extra", [
    ({"cupy-cuda12x": "14.2.0", "torch": "2.13.0+cu130"}, "cu12"),  # CuPy decides
    ({"torch": "2.13.0+cu126"}, "cu12"),
    ({"torch": "2.13.0+cu130"}, "cu13"),
    ({"torch": "2.13.0+cpu"}, None),
    ({}, None),
])
def test_suggested_extra(monkeypatch, installed, extra):
    def version(name):
        if name in installed:
            return installed[name]
        raise cuda_env.importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(cuda_env.importlib.metadata, "version", version)
    assert cuda_env.suggested_extra() == extra
    hint = cuda_env.install_hint()
    assert (f"pip install '.[{extra}]'" in hint) if extra else ("'.[cu13]'" in hint and "'.[cu12]'" in hint)


# ---- gen-programs -------------------------------------------------------------------------

def invoke(*args):
    return CliRunner().invoke(cli.main, list(args))


def test_compile_without_a_cuda_extra_names_it(monkeypatch):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.nvrtc"):  # importing CuPy fails as if it were not installed
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(cuda_env, "suggested_extra", lambda: "cu13")
    r = invoke("compile", "--family", "oneshot", "--dtype", "bf16", "--world-size", "2", "--profile", spec.PLAIN)
    assert r.exit_code == 1 and not isinstance(r.exception, ImportError), r.output
    assert "NVRTC: CuPy is not installed" in r.output and "pip install '.[cu13]'" in r.output
    assert "Traceback" not in r.output and "compiling" not in r.output


def test_compile_without_headers_names_the_extra(monkeypatch):
    monkeypatch.setattr(cuda_env, "load_nvrtc", lambda: (None, (12, 9)))
    monkeypatch.setattr(cuda_env, "_candidates", lambda: [])
    r = invoke("compile", "--family", "oneshot", "--dtype", "bf16", "--world-size", "2", "--profile", spec.PLAIN)
    assert r.exit_code == 1, r.output
    assert "CUDA 12 headers (NVRTC is 12.x) not found" in r.output and "pip install '.[cu12]'" in r.output


def test_arch_lists_the_targets():
    r = invoke("compile", "--arch", "sm_80")
    assert r.exit_code == 2 and "'sm_80' is not one of 'sm_90a', 'sm_100a'" in r.output, r.output
    assert "[sm_90a|sm_100a]" in invoke("compile", "--help").output
    assert tuple(spec.ARCH_TARGETS) == ("sm_90a", "sm_100a")


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_jobs_below_one_are_refused(jobs):
    for flag in ("-j", "--jobs"):
        r = invoke("compile", flag, jobs)
        assert r.exit_code == 2 and "is not in the range x>=1" in r.output, r.output


def test_a_filter_on_holes_says_which_family_runs():
    manifest = json.loads((ROOT / "generated" / "manifest.json").read_text())
    reason = next(h["reason"] for h in manifest["holes"]
                  if h["family"] == "twoshot_pipelined" and h["world_size"] == 4)
    for command in ("list", "compile"):
        r = invoke(command, "--family", "twoshot_pipelined", "--world-size", "4")
        assert r.exit_code == 1, r.output
        assert r.output == (f"Error: twoshot_pipelined has no program at world size 4 (hole: {reason}); "
                            f"calls there run twoshot\n"), r.output


def test_holes_of_several_reasons_each_get_a_line():
    r = invoke("list", "--family", "twoshot_pipelined_loads", "--profile", spec.PLAIN)
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert len(lines) == 2, r.output
    assert lines[0].startswith(f"Error: twoshot_pipelined_loads has no program at world size 2, profile {spec.PLAIN} "
                               f"(hole: ")
    assert lines[0].endswith("; calls there run twoshot_pipelined")
    others = "/".join(str(w) for w in spec.WORLD_SIZES if w > 2)
    assert lines[1].startswith(f"twoshot_pipelined_loads has no program at world sizes {others}, profile {spec.PLAIN} (hole: ")
    assert lines[1].endswith("; calls there run twoshot")


def test_a_world_size_outside_a_familys_own_is_named_as_such():
    """World size 1 and the exchange world sizes are two spaces: a filter that crosses them finds no hole,
    and says whose world sizes those are and what runs there."""
    r = invoke("list", "--family", "local", "--world-size", "4")
    assert r.exit_code == 1 and r.output == (
        "Error: local has no program at world size 4: its world size is 1; no call selects it with peers\n"), r.output
    r = invoke("list", "--family", "twoshot_pipelined_loads", "--world-size", "1")
    assert r.exit_code == 1 and r.output == (
        "Error: twoshot_pipelined_loads has no program at world size 1: its world sizes are 2/4/8/16; with no "
        "peers every exchange rung runs local there\n"), r.output
    r = invoke("list", "--family", "twoshot_pipelined_loads", "--world-size", "1", "--world-size", "4")
    assert r.exit_code == 1 and r.output.splitlines()[1] == (
        "twoshot_pipelined_loads has no program at world size 1: its world sizes are 2/4/8/16; with no peers every "
        "exchange rung runs local there"), r.output


def test_a_filter_with_programs_lists_them():
    r = invoke("list", "--family", "twoshot_pipelined", "--dtype", "bf16")
    assert r.exit_code == 0 and "moe_ar_twoshot_pipelined_bf16_ws2_plain" in r.output, r.output


@pytest.fixture
def installed(monkeypatch):
    """gen-programs as a wheel runs it: no checkout around the generator, package data at ROOT's layout."""
    monkeypatch.setattr(locations, "checkout_root", lambda: None)
    monkeypatch.setattr(locations, "installed_root", lambda: ROOT)


def test_installed_gen_programs_reads_the_installed_tree(installed):
    assert "moe_ar_oneshot_bf16_ws2_plain" in invoke("list").output
    assert invoke("tables").exit_code == 0
    r = invoke("--check")
    assert r.exit_code == 0 and "up to date" in r.output, r.output


def test_installed_gen_programs_needs_a_repository_or_out(installed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke()
    assert r.exit_code == 1, r.output
    assert "regenerating needs a repository or --out DIR" in r.output and "clone of the repository" in r.output
    r = invoke("diff", "HEAD")
    assert r.exit_code == 2 and "diff (it reads the git history) needs a repository" in r.output, r.output
    # Run inside another checkout, the message names it.
    monkeypatch.chdir(ROOT / "tests")
    r = invoke()
    assert f"the checkout at {ROOT} is not the one this gen-programs runs from" in r.output, r.output
    r = invoke("--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "manifest.json").read_bytes() == (ROOT / "generated" / "manifest.json").read_bytes()


def _clone(dest: pathlib.Path) -> pathlib.Path:
    """A checkout of this project elsewhere (what `git clone` gives, less the history)."""
    for name in ("generator", "moe_ar_common", "templates", "kernels", "generated", "bench_results"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_check_in_a_clone_does_not_answer_for_the_installed_tree(tmp_path, monkeypatch, pyproject):
    """Installed non-editable and run in a clone whose kernel changed, --check would compare the
    installed copy with itself and say "up to date": it refuses and says the fix instead; outside
    any checkout it still checks the installed copy."""
    site = _fake_site(tmp_path, pyproject)
    clone = _clone(tmp_path / "clone")
    lamport = clone / "kernels" / "lamport.cuh"
    lamport.write_text(lamport.read_text().replace("kSentinelWord = 0x80008000u", "kSentinelWord = 0x80000000u"))
    monkeypatch.setattr(locations, "checkout_root", lambda: None)
    monkeypatch.setattr(locations, "installed_root", lambda: site / "moe_ar_data")
    monkeypatch.chdir(clone / "kernels")
    r = invoke("--check")
    assert r.exit_code == 1 and "up to date" not in r.output, r.output
    assert f"not on the checkout you are in ({clone})" in r.output and "`pip install -e .`" in r.output, r.output
    monkeypatch.chdir(tmp_path)
    r = invoke("--check")
    assert r.exit_code == 0 and "up to date" in r.output, r.output


def test_another_checkouts_gen_programs_does_not_work_on_this_one(tmp_path, monkeypatch):
    """An editable install of one checkout, run in another: regenerating, --check and diff would work
    on the first; each refuses and names both."""
    other = _clone(tmp_path / "other")
    monkeypatch.setattr(locations, "checkout_root", lambda: other)
    monkeypatch.chdir(ROOT)
    for args, status in (((), 1), (("--check",), 1), (("diff", "HEAD"), 2)):  # diff: 1 means changes
        r = invoke(*args)
        assert r.exit_code == status, (args, r.output)
        assert f"not on the checkout you are in ({ROOT})" in r.output and f"the checkout at {other}" in r.output, r.output
    r = invoke("--out", str(tmp_path / "out"))  # an explicit destination is no surprise
    assert r.exit_code == 0, r.output


def test_no_sources_at_all(monkeypatch):
    monkeypatch.setattr(locations, "checkout_root", lambda: None)
    monkeypatch.setattr(locations, "installed_root", lambda: None)
    for args in ((), ("list",)):
        r = invoke(*args)
        assert r.exit_code == 1 and "found neither a source checkout" in r.output, r.output


def test_runtime_compile_without_a_cuda_extra_names_it(monkeypatch):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.nvrtc"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(cuda_env, "suggested_extra", lambda: "cu12")
    monkeypatch.setattr(registry.cuda_env, "suggested_extra", lambda: "cu12")
    with pytest.raises(registry.cuda_env.MissingToolchain, match=r"pip install '\.\[cu12\]'"):
        registry.LoadedProgram("moe_ar_oneshot_bf16_ws2_plain", 0)
    with pytest.raises(registry.cuda_env.MissingToolchain, match=r"pip install '\.\[cu12\]'"):
        registry.compile_cubin("", "moe_ar_oneshot_bf16_ws2_plain", "sm_90a")
