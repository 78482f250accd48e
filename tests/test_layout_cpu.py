"""The repository's layout (CPU): dispatch/ is the runtime only and imports none of the tools; the
runtime and the generator never import each other (both may import moe_ar_common); dispatch/'s
modules are each of one concern and import each other one way; the tools (benchmark, soak,
reference, summary) live in moe_ar_tools/, the probes in experiments/, the example in examples/, and tests/ holds tests
and their helpers only. Modules stay small (MAX_MODULE_LINES) and the tools' imports among
themselves form no cycle."""
from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = "moe_ar_tools"
COMMON = "moe_ar_common"
MAX_MODULE_LINES = 600  # a longer module is split by concern


def _imported_modules(path: pathlib.Path) -> set:
    """Every module an import statement in `path` names (relative imports resolved to their package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_importing_dispatch_imports_no_tool():
    code = ("import sys, dispatch, dispatch.op, dispatch.torch_op, dispatch.flashinfer_compat\n"
            f"loaded = sorted(m for m in sys.modules if m == {TOOLS!r} or m.startswith({TOOLS!r} + '.'))\n"
            "assert not loaded, loaded\n"
            "assert 'matplotlib' not in sys.modules and 'click' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_dispatch_source_names_a_tool():
    for path in sorted((ROOT / "dispatch").glob("*.py")):
        tools = sorted(m for m in _imported_modules(path) if m.split(".")[0] in (TOOLS, "tests", "examples"))
        assert not tools, f"{path.relative_to(ROOT)} imports {tools}"
        assert TOOLS not in path.read_text(), f"{path.relative_to(ROOT)} names {TOOLS}"


def _dispatch_modules() -> dict:
    """dispatch's module names (the package itself as "dispatch") -> their files."""
    return {("dispatch" if p.stem == "__init__" else f"dispatch.{p.stem}"): p
            for p in sorted((ROOT / "dispatch").glob("*.py"))}


def test_every_dispatch_module_imports():
    import importlib
    for name in _dispatch_modules():
        importlib.import_module(name)


def test_dispatch_modules_import_each_other_one_way():
    """The graph of imports between dispatch's modules (at a module's top or in a function) has no
    cycle. Importing the package itself (from . import x) is not an edge: Python runs it first."""
    modules = _dispatch_modules()
    graph = {name: sorted(m for m in _imported_modules(path) if m in modules and m not in ("dispatch", name))
             for name, path in modules.items()}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for dep in graph[name]:
            visit(dep)
        path.pop()
        done.add(name)

    for name in graph:
        visit(name)


def test_the_runtime_and_the_generator_never_import_each_other():
    """The manifest is their only interface: the runtime imports neither the generator nor jinja2, the
    generator never the runtime. What both need is in moe_ar_common, which either may import and which
    imports neither: the standard library at its top, CuPy and pip's nvidia headers only inside the
    functions that compile."""
    def imported(package, top_only=False):
        names = set()
        for path in (ROOT / package).glob("*.py"):
            tree = ast.parse(path.read_text())
            nodes = tree.body if top_only else ast.walk(tree)
            for node in nodes:
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names.add(node.module.split(".")[0])
        return names
    assert not imported("dispatch") & {"generator", "jinja2", "click"}, imported("dispatch")
    assert "dispatch" not in imported("generator")
    assert COMMON in imported("dispatch") and COMMON in imported("generator")
    stdlib = set(sys.stdlib_module_names)
    assert imported(COMMON, top_only=True) <= stdlib, imported(COMMON, top_only=True) - stdlib
    assert imported(COMMON) <= stdlib | {"cupy", "nvidia"}, imported(COMMON) - stdlib
    code = ("import sys, dispatch, dispatch.op, dispatch.torch_op, dispatch.flashinfer_compat\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('generator', 'jinja2')], 'runtime'\n"
            "import generator.cli, generator.render, generator.nvrtc_build\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    code = ("import sys, generator.cli, generator.render, generator.nvrtc_build, generator.diffing\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'dispatch'], 'generator'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_dispatch_is_the_runtime_only():
    modules = {p.stem for p in (ROOT / "dispatch").glob("*.py")}
    assert not {m for m in modules if any(word in m for word in ("bench", "soak", "example", "probe"))}, modules
    assert not [p for p in (ROOT / "dispatch").iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_tools_and_example_are_where_the_commands_say():
    for module in ("reliability_summary", "provenance"):
        assert (ROOT / TOOLS / f"{module}.py").is_file(), module
    for package in ("bench", "bench_one", "soak", "reference"):
        assert (ROOT / TOOLS / package / "__init__.py").is_file(), package
    for command in ("bench", "bench_one", "soak"):  # python -m moe_ar_tools.bench / .bench_one / .soak (run_gpu.sh)
        assert (ROOT / TOOLS / command / "__main__.py").is_file(), command
    assert not (ROOT / TOOLS / "probes").exists()  # one-off probes are experiments (experiments/README.md)
    assert (ROOT / "examples" / "moe_tail.py").is_file()
    assert "torchrun --nproc-per-node 2 examples/moe_tail.py" in (ROOT / "examples" / "moe_tail.py").read_text()


def test_the_example_does_not_import_the_benchmark():
    imported = _imported_modules(ROOT / "examples" / "moe_tail.py")
    assert not [m for m in imported if m.startswith(f"{TOOLS}.bench") or m.endswith(".bench")], imported


def test_tests_hold_no_tools():
    """Every Python file in tests/ is a test module, the pytest setup, or a helper the tests import."""
    helpers = {"conftest.py", "multiproc.py", "gpu_worlds.py"}
    strays = [p.name for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_") and p.name not in helpers]
    assert not strays, strays


def test_console_scripts_and_packages():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; the project supports 3.10)
    for script, target in (("moe-ar-bench", f"{TOOLS}.bench.cli:main"),
                           ("moe-ar-bench-one", f"{TOOLS}.bench_one:main"),
                           ("moe-ar-soak", f"{TOOLS}.soak.cli:main")):
        assert re.search(rf'^{script} = "{re.escape(target)}"$', text, re.M), script
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name)), target
    # The packages are listed one by one (pyproject.toml maps the data folders too): every package
    # of the tools must be there.
    listed = re.search(r"^\[tool\.setuptools\]\npackages = \[(.*?)\]$", text, re.M | re.S).group(1)
    tools = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / TOOLS).rglob("__init__.py")}
    assert {"dispatch", "generator", COMMON, TOOLS, *tools} <= set(re.findall(r'"([^"]+)"', listed))


# Libraries a module may need that the project does not install for everyone: the Triton baselines
# (moe_ar_tools/baselines/triton_kernels.py) import Triton, which the test extra brings.
OPTIONAL_IMPORTS = frozenset({"triton"})


def test_every_import_of_the_project_resolves():
    """Each `from <project module> import <name>` anywhere in the runtime, the generator, the tools,
    the examples and the tests (also inside functions, which only run on a GPU machine) names a module
    or attribute that exists: a tool moved by a clean-up must not leave an import behind."""
    import importlib
    ROOT_ = pathlib.Path(__file__).resolve().parent.parent
    project = ("dispatch", "generator", COMMON, "moe_ar_tools")
    missing = []
    for folder in ("dispatch", "generator", COMMON, "moe_ar_tools", "examples", "tests", "docs"):
        for path in sorted((ROOT_ / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in project):
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError as e:
                            if e.name not in OPTIONAL_IMPORTS:
                                missing.append(f"{path.relative_to(ROOT_)}:{node.lineno}: {node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.relative_to(ROOT_)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing


# ---- module size and the tools' import graph -------------------------------------------------------

def _too_long(folder: str) -> list:
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
               for p in sorted((ROOT / folder).rglob("*.py"))}
    return [f"{path}: {n} lines" for path, n in lengths.items() if n > MAX_MODULE_LINES]


def test_no_tool_module_is_too_long():
    assert not _too_long(TOOLS), _too_long(TOOLS)


def test_no_dispatch_module_is_too_long():
    assert not _too_long("dispatch"), _too_long("dispatch")


def _tool_modules() -> dict:
    """Dotted name -> path of every module of the tools (a package by its __init__.py)."""
    out = {}
    for path in sorted((ROOT / TOOLS).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _tool_imports(path: pathlib.Path, modules: dict) -> set:
    """The tool modules `path` imports (inside functions too): `from a.b import c` names a.b.c when
    that is a module, else a.b; `import a.b` names a.b."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
    return names & set(modules)


def _find_cycle(graph: dict):
    """A list of modules that import each other in a circle (the first one repeated at the end), or None."""
    state = {}  # module -> "open" while on the current path, "done" after

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            if cycle:
                return cycle
    return None


def test_the_tools_import_graph_has_no_cycle():
    modules = _tool_modules()
    assert {f"{TOOLS}.bench.cli", f"{TOOLS}.soak.cli", f"{TOOLS}.reference.checks"} <= set(modules)
    graph = {name: _tool_imports(path, modules) for name, path in modules.items()}
    assert graph[f"{TOOLS}.soak.runner"] >= {f"{TOOLS}.soak.calls", f"{TOOLS}.provenance"}
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle(tmp_path):
    # a package whose __init__ imports a module (inside a function too) that imports the package back
    init, timing = tmp_path / "init.py", tmp_path / "timing.py"
    init.write_text("def f():\n    from moe_ar_tools.bench import timing\n")
    timing.write_text("import math\nfrom moe_ar_tools.bench import median\n")
    modules = {f"{TOOLS}.bench": init, f"{TOOLS}.bench.timing": timing}
    graph = {name: _tool_imports(path, modules) for name, path in modules.items()}
    assert graph == {f"{TOOLS}.bench": {f"{TOOLS}.bench.timing"}, f"{TOOLS}.bench.timing": {f"{TOOLS}.bench"}}
    assert _find_cycle(graph) == [f"{TOOLS}.bench", f"{TOOLS}.bench.timing", f"{TOOLS}.bench"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_every_tool_module_imports_without_a_gpu():
    names = sorted(_tool_modules())
    code = ("import importlib, sys\nfor name in sys.argv[1:]:\n    try:\n        importlib.import_module(name)\n"
            f"    except ModuleNotFoundError as e:\n        if e.name not in {sorted(OPTIONAL_IMPORTS)!r}:\n"
            "            raise\n")
    r = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("command, usage", [("bench", "Usage: python -m moe_ar_tools.bench "),
                                            ("bench_one", "Usage: python -m moe_ar_tools.bench_one "),
                                            ("soak", "usage: moe-ar-soak"),
                                            ("tune", "Usage: python -m moe_ar_tools.tune ")])
def test_python_m_runs_each_command(command, usage):
    """tests/run_gpu.sh runs the tools as python -m moe_ar_tools.bench / .bench_one / .soak / .tune."""
    r = subprocess.run([sys.executable, "-m", f"{TOOLS}.{command}", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.startswith(usage), r.stdout[:500] + r.stderr[-2000:]
