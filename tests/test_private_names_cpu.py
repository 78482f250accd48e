"""No module of dispatch/ reaches into another's private names (issue 44, "rooms with doors").

A name with a leading underscore belongs to the object or module that defines it; another module
that reads or sets one depends on what its owner may change freely. Counted in dispatch/*.py, for
the private names dispatch itself defines (an attribute set on self or by setattr, a method, a
module-level name), so torch's own (`torch._C`) do not count:

* `x._name` where x is not `self` or `cls`: another object's attribute, or another module's name;
* getattr / hasattr / setattr / delattr of such a name (a string, or a module-level string constant);
* `from .module import _name`.

ALLOWED names the ones that must stay, each with why. Run as a script to list every crossing:
`python tests/test_private_names_cpu.py [DIR]` (default: this checkout's dispatch/).
"""
from __future__ import annotations

import ast
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

ALLOWED = {
    # The workspace is the user's object: its one door for the package's modules is this private
    # attribute, a WorkspaceState whose own names are the package's interface (dispatch/workspace_state.py).
    "_moe_ar_state": "the workspace's WorkspaceState (dispatch/workspace_state.py)",
    # torch_op.py keeps its handle on the workspace; it could move into WorkspaceState with that
    # module's next change (the attribute read must stay free of graph breaks under dynamo).
    "_moe_ar_op_handle": "torch_op.py's op handle on the workspace",
}

_ATTR_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.endswith("__")


def _string_constants(tree) -> dict:
    """Module-level NAME = "string" assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _attr_call_name(node, constants):
    """The attribute name of a getattr/hasattr/setattr/delattr call, or None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_CALLS
            and len(node.args) >= 2):
        return None
    arg = node.args[1]
    if isinstance(arg, ast.Constant):
        return arg.value
    if isinstance(arg, ast.Name):
        return constants.get(arg.id)
    return None


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _trees(folder: pathlib.Path) -> dict:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(folder.glob("*.py"))}


def defined_names(trees: dict) -> set:
    """Every private name the modules define: attributes set on self or by setattr, functions,
    classes and module- or class-level assignments."""
    names = set()
    for tree in trees.values():
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                names.add(_attr_call_name(node, constants))
    return {n for n in names if _private(n)}


def crossings(folder: pathlib.Path = ROOT / "dispatch") -> list[tuple[str, int, str, str]]:
    """(file, line, private name, the expression) of every use of a private name from outside its owner."""
    trees = _trees(folder)
    defined = defined_names(trees)
    found = []
    for path, tree in trees.items():
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            name = text = None
            if isinstance(node, ast.Attribute) and not _is_self(node.value):
                name, text = node.attr, ast.unparse(node)
            elif isinstance(node, ast.Call) and _attr_call_name(node, constants) is not None and not _is_self(node.args[0]):
                name, text = _attr_call_name(node, constants), ast.unparse(node)
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dispatch")):
                for alias in node.names:
                    if _private(alias.name):
                        found.append((path.name, node.lineno, alias.name, f"from {node.module} import {alias.name}"))
                continue
            if _private(name) and name in defined:
                found.append((path.name, node.lineno, name, text))
    return sorted(found)


def test_no_private_name_crosses_a_module_border():
    crossing = [c for c in crossings() if c[2] not in ALLOWED]
    assert not crossing, "private names used outside their owner (give the owner an interface):\n" + "\n".join(
        f"  dispatch/{f}:{line}: {text}" for f, line, _name, text in crossing)


def test_the_scan_finds_what_it_counts(tmp_path):
    """Another object's attribute, a getattr by constant and a private import are found; self's own
    names and names dispatch does not define (torch's) are not."""
    (tmp_path / "a.py").write_text(
        "import torch\n_HIDDEN = '_tag'\n\ndef _helper():\n    pass\n\nclass A:\n"
        "    def __init__(self):\n        self._x = 1\n        setattr(self, _HIDDEN, 2)\n"
        "    def own(self):\n        return self._x, torch._C\n")
    (tmp_path / "b.py").write_text(
        "from .a import _helper\n\ndef f(a):\n    return a._x, getattr(a, '_tag'), a.row._replace()\n")
    assert [(f, name) for f, _line, name, _text in crossings(tmp_path)] == [("b.py", "_helper"), ("b.py", "_tag"),
                                                                          ("b.py", "_x")]


def test_the_allowed_names_are_still_used():
    """An allowed name nothing uses any more leaves the list."""
    used = {c[2] for c in crossings()}
    assert set(ALLOWED) <= used, sorted(set(ALLOWED) - used)


if __name__ == "__main__":
    found = crossings(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dispatch")
    for f, line, name, text in found:
        print(f"{f}:{line}: {name}: {text}{'  (allowed)' if name in ALLOWED else ''}")
    per_name = collections.Counter(c[2] for c in found)
    print(f"{len(found)} uses of {len(per_name)} private names across modules: "
          + ", ".join(f"{n} {k}" for n, k in per_name.most_common()))
