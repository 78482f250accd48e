"""The tune output: one JSON file, rewritten after every unit.

    format, version   generator/table_sets.py TUNE_FORMAT / TUNE_VERSION (the runtime checks both)
    name              the set's name
    stamp             moe_ar_tools/stamp.py: the machine, the software, the program set's sha256
    config            what was asked for (shapes, tokens, profiles, reps, ...)
    done              the units measured (units.Unit.key), so a stopped run resumes after them
    measurements      one record per program and unit: the slowest rank's median, noise, percentiles,
                      whether it matched the reference (and why not)
    set               the fitted table set: match (stamp.match), program_set_sha256, boundaries (rows
                      as the manifest's sets have them): what the runtime reads
    complete          every unit planned was measured; truncated: the time budget stopped the run
"""
from __future__ import annotations

import json
import os
import pathlib

from generator import manifest, table_sets

from .. import stamp as stamps


def new_document(name: str, stamp: dict, config: dict) -> dict:
    return {"format": table_sets.TUNE_FORMAT, "version": table_sets.TUNE_VERSION, "name": name, "stamp": stamp,
            "config": config, "done": [], "measurements": [], "set": None, "complete": False, "truncated": False}


def load(path: pathlib.Path) -> dict | None:
    """The output of an earlier run to resume, None where there is none; ValueError naming `out`
    where the file is something else."""
    path = pathlib.Path(path)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"out: {path} exists and is not a tune output ({type(e).__name__}: {e}); give another "
                         f"--out or remove it") from None
    if not isinstance(doc, dict) or doc.get("format") != table_sets.TUNE_FORMAT:
        raise ValueError(f"out: {path} exists and is not a tune output; give another --out or remove it")
    return doc


def resume_refused(doc: dict, stamp: dict) -> str | None:
    """Why an earlier output may not be continued with measurements stamped `stamp`; None when it may."""
    if doc.get("version") != table_sets.TUNE_VERSION:
        return f"it is of version {doc.get('version')!r}, this tune writes {table_sets.TUNE_VERSION}"
    if doc["stamp"].get("program_set_sha256") != stamp["program_set_sha256"]:
        return "it measured other programs (another program set sha256)"
    before, now = stamps.match(doc["stamp"]), stamps.match(stamp)
    for field in now:
        if before.get(field) != now[field]:
            return f"it was measured on {field} {before.get(field)!r}, this machine has {now[field]!r}"
    return None


def add(doc: dict, unit, records: list) -> None:
    doc["done"].append(unit.key)
    doc["measurements"].extend(records)


def refit(doc: dict, file_name: str) -> None:
    """The set section from every valid measurement so far (generator/table_sets.py fitted_cells:
    the cells measured, and those a donor covers; the runtime takes the rest from its chain)."""
    measured = table_sets.parse_measurements(doc, file_name)
    cells = table_sets.fitted_cells({cell: (file_name, points) for cell, points in measured.cells.items()})
    fitted = table_sets.TableSet(doc["name"], doc["name"], stamps.match(doc["stamp"]), (), cells)
    doc["set"] = {"name": doc["name"], "match": stamps.match(doc["stamp"]),
                  "program_set_sha256": doc["stamp"]["program_set_sha256"],
                  "boundaries": manifest.selection_set(fitted)["boundaries"]}


def write(path: pathlib.Path, doc: dict) -> None:
    """Atomically: a run killed while writing leaves the previous file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
