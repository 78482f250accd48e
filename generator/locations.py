"""Where gen-programs reads its inputs and the generated tree.

Two layouts hold the same files under one root folder: templates/, kernels/, generated/ and
the measurement files of the committed table sets in bench_results/ (table_sets.COMMITTED_SETS).

- A source checkout (or an editable install of one): the folder above this package. `gen-programs`
  regenerates its generated/.
- An installed wheel: the package data `moe_ar_data` (pyproject.toml maps the three folders into
  it, and kernels/). Read-only: `list`, `tables`, `compile` and `--check` read it, `--out DIR` renders from it.

The checkout comes first, so code run from a checkout (PYTHONPATH=.) never pairs with another
installation's files.
"""
from __future__ import annotations

import importlib.resources
import pathlib

DATA_PACKAGE = "moe_ar_data"
# A file every layout has (the kernel body's entry header); a folder without it is not one of ours.
_MARKER = ("kernels", "moe_finalize_allreduce.cuh")


def _holds_sources(root: pathlib.Path) -> bool:
    return root.joinpath(*_MARKER).is_file()


def checkout_root() -> pathlib.Path | None:
    """The source checkout this generator runs from, None when it is installed from a wheel."""
    root = pathlib.Path(__file__).resolve().parent.parent
    return root if _holds_sources(root) else None


def installed_root() -> pathlib.Path | None:
    """The installed package data (moe_ar_data), None when it is not installed."""
    try:
        root = importlib.resources.files(DATA_PACKAGE)
    except ModuleNotFoundError:
        return None
    # A wheel installed by pip is a folder on disk; a zipped import is not supported.
    if not isinstance(root, pathlib.Path) or not _holds_sources(root):
        return None
    return root


def source_root() -> pathlib.Path | None:
    """Where the inputs are: the checkout, else the installed package data."""
    return checkout_root() or installed_root()


def enclosing_checkout(start: pathlib.Path) -> pathlib.Path | None:
    """A checkout of this repository containing `start` (to name it in an error), else None."""
    for folder in [start, *start.parents]:
        if _holds_sources(folder) and (folder / "generator").is_dir() and (folder / "pyproject.toml").is_file():
            return folder
    return None
