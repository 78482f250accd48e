"""Every repository path named in the docs and in comments exists: a file moved by a clean-up must
not leave a pointer behind. Paths with a placeholder (`run-<date>`, `$OUT/...`, `{name}`) are not
checked; a path followed by `*` names a prefix, which some file must start with."""
from __future__ import annotations

import ast
import io
import pathlib
import re
import subprocess
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = ("dispatch", "generator", "templates", "generated", "kernels", "tests", "moe_ar_tools", "moe_ar_common",
       "docs", "examples", "bench_results", "experiments", ".ci")
PATH = re.compile(r"(?<![\w./$<{:-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[A-Za-z0-9_./-]*[A-Za-z0-9_/])")
PLACEHOLDER = set("<{$")


def _tracked() -> list:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()
    return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def _python_prose(text: str) -> str:
    """A Python file's comments and docstrings."""
    parts = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    parts.append(doc)
    except (SyntaxError, tokenize.TokenError):
        return text
    return "\n".join(parts)


def _c_prose(text: str) -> str:
    """The // comments of a CUDA source or template."""
    return "\n".join(line.split("//", 1)[1] for line in text.splitlines() if "//" in line)


def _prose_of(path: str, text: str) -> str:
    if path.endswith(".py"):
        return _python_prose(text)
    if path.endswith((".cuh", ".cu", ".j2", ".h")):
        return _c_prose(text)
    return text  # markdown, shell: the whole text


def dangling_paths(files: list, exists) -> list:
    """'name <- where' for each path named in the prose of `files` that `exists` denies."""
    out = []
    for f in files:
        text = (ROOT / f).read_text(errors="replace")
        for m in PATH.finditer(_prose_of(f, text)):
            path, rest = m.group(1), m.string[m.end():m.end() + 2]
            if m.string[max(0, m.start() - 6):m.start()] in ("--out ", "--out="):
                continue  # where a command writes
            if rest[:1] in PLACEHOLDER or rest[:2] in ("-<", "_<", ".<", "-{", "_{", ".{", "-$", "_$"):
                continue
            prefix = rest[:1] == "*" or rest[:2] in ("-*", ".*", "_*")
            path = path.rstrip(".") if not prefix else path
            if not exists(path, prefix):
                out.append(f"{path}{'*' if prefix else ''} <- {f}")
    return sorted(set(out))


def _scanned() -> list:
    files = _tracked()
    return [f for f in files
            if (f.endswith((".md", ".py", ".cuh", ".cu", ".j2", ".sh")) and not f.startswith(("generated/", "bench_results/")))
            or (f.startswith("bench_results/") and f.endswith("README.md"))]


def _exists_in(files: list):
    tracked = set(files)
    dirs = {str(pathlib.PurePosixPath(f).parent) for f in files}
    dirs |= {str(p) for f in files for p in pathlib.PurePosixPath(f).parents}

    def exists(path: str, prefix: bool) -> bool:
        path = path.rstrip("/")
        if prefix:
            return any(f.startswith(path) for f in tracked)
        return path in tracked or path in dirs or (ROOT / path).exists()
    return exists


def test_every_repository_path_named_in_docs_and_comments_exists():
    files = _tracked()
    missing = dangling_paths(_scanned(), _exists_in(files))
    assert not missing, "\n".join(missing)


def test_the_path_check_sees_a_dangling_path(tmp_path, monkeypatch):
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("See moe_ar_tools/reference.py and tests/conftest.py; runs land in bench_results/run-<date>/ "
                   "and bench_results/gpu_tests/h200-2026-12-02-6d2afe9-*; `git show abc:kernels/old.cuh`, "
                   "`--out bench_results/new.json`.\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    exists = _exists_in(["tests/conftest.py", "bench_results/gpu_tests/h200-2026-12-02-6d2afe9-triton-baseline.txt"])
    assert dangling_paths(["docs/x.md"], exists) == ["moe_ar_tools/reference.py <- docs/x.md"]
    py = tmp_path / "tests" / "y.py"
    py.parent.mkdir()
    py.write_text('"""Reads kernels/gone.cuh."""\nx = "kernels/also_gone.cuh"  # but not kernels/vector.cuh\n')
    exists = _exists_in(["kernels/vector.cuh"])
    assert dangling_paths(["tests/y.py"], exists) == ["kernels/gone.cuh <- tests/y.py"]  # strings are code
