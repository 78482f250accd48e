"""Table sets: the selection boundaries of one kind of machine, fitted to its measurements.

A set is keyed by what the crossovers depend on (`match`: GPU product, compute capability,
interconnect) and holds every cell: fitted where its measurement files measured the cell (a dtype
with no measurement of its own borrows the other dtype's, same bytes an element; a profile with
none borrows the plain profile's: the exchange is the same), the written model elsewhere. Each
cell says where its numbers came from. The written model is a set of its own, `model`: the
runtime's last fallback (dispatch/table_sets.py picks a set per device: exact product, then the same
capability and interconnect, then the model).

A set's files are moe-ar-bench results or `gen-programs tune` outputs (format TUNE_FORMAT); each
file's stamp must agree with the set's key. Adding a file to COMMITTED_SETS (or a set) is a
reviewable table diff (`gen-programs diff`); the wheel ships the file where pyproject.toml's
package-data names it too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from . import fit, spec, tuning

# What `gen-programs tune` writes and the runtime reads as a user's own set (the runtime's copy
# of these two names: dispatch/table_sets.py).
TUNE_FORMAT = "moe_ar_table_set"
TUNE_VERSION = 1
MODEL_NAME = "model"


@dataclasses.dataclass(frozen=True)
class Declared:
    """A committed set: its name, its key and the files it is fitted to (repository-relative)."""
    name: str
    title: str
    match: dict          # product, capability, interconnect
    files: tuple[str, ...]


# In the order the runtime tries them at the same match level.
COMMITTED_SETS = (
    Declared("h200_nvlink", title="NVIDIA H200, NVLink (2x H200 at world size 2, one H200 at world size 1)",
             match={"product": "NVIDIA H200", "capability": "9.0", "interconnect": "nvlink"},
             files=("bench_results/h200x2-2026-11-30-529cb84-bf16.json",
                    "bench_results/tuning/h200-ws1-2026-12-03-stream-builds.json")),
)


@dataclasses.dataclass(frozen=True)
class TableSet:
    name: str
    title: str
    match: dict | None           # None: the written model, for any device
    sources: tuple[dict, ...]    # {file, stamp} of each measurement file
    boundaries: dict             # (dtype, world_size, profile) -> tuning.Boundaries, every cell

    @property
    def table(self) -> str:
        """The rendered header of this set, relative to generated/."""
        return f"tables/selection_{self.name}.h"


# ---- measurement files ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Measurements:
    """One file: (dtype, world size, profile) -> {(hidden, top_k, shared, T): {family: fit.Time}}."""
    file: str
    stamp: dict
    cells: dict


def _program_of(name: str) -> spec.ProgramSpec | None:
    """The program a record names: today's name, or the code form a file measured before names
    spelled the family (the committed files keep the names they were measured under)."""
    try:
        return spec.parse_recorded(name)
    except ValueError:
        return None  # a baseline or "auto"


def _bench_stamp(doc: dict) -> dict:
    """A moe-ar-bench result's header as a stamp (the fields the bench records; the rest absent)."""
    versions = doc.get("versions") or {}
    return {"gpu": {"product": doc.get("gpu"), "count": doc.get("world_size")},
            "interconnect": {"peer_bandwidth_GBps": (doc.get("bandwidth") or {}).get("nvlink_GBps")},
            "driver": doc.get("driver"), "cuda": versions.get("cuda"), "torch": versions.get("torch"),
            "commit": doc.get("commit"), "date": doc.get("date")}


def read_measurements(root: pathlib.Path, rel: str) -> Measurements:
    """The valid, non-emulated times of the ladder's base programs in one file (a moe-ar-bench
    result or a tune output). Noise: half the spread between the 10th and 90th percentile of the
    replays (a tune output records it as noise_us)."""
    path = pathlib.Path(root) / rel
    if not path.is_file():
        raise ValueError(f"table_sets: {rel}, a file a committed set is fitted to, is missing under {root}")
    return parse_measurements(json.loads(path.read_text()), rel)


def parse_measurements(doc: dict, rel: str) -> Measurements:
    """read_measurements of a file's parsed JSON (`rel` names it in errors and sources)."""
    if doc.get("format") == TUNE_FORMAT:
        if doc.get("version") != TUNE_VERSION:
            raise ValueError(f"table_sets: {rel}: version {doc.get('version')!r}, this generator reads {TUNE_VERSION}")
        stamp, records, name_field = doc["stamp"], doc["measurements"], "program"
    else:  # a bench record's `program` is what its system ran (auto's choice): the forced ones are named by `system`
        stamp, records, name_field = _bench_stamp(doc), doc.get("records", []), "system"
    cells: dict = {}
    for record in records:
        program = _program_of(record.get(name_field, ""))
        if (program is None or program.family not in tuning.LADDER_FAMILIES or record.get("emulated")
                or not record.get("valid", True)):
            continue
        noise = record.get("noise_us")
        if noise is None:
            noise = (record["p90_us"] - record["p10_us"]) / 2 if "p90_us" in record else 0.0
        point = (record["hidden"], record["top_k"], bool(record["shared"]), record["tokens"])
        cell = cells.setdefault((program.dtype, program.world_size, program.profile), {})
        cell.setdefault(point, {})[program.family] = fit.Time(record["median_us"], noise)
    return Measurements(rel, stamp, cells)


def _check_stamp(declared: Declared, measurements: Measurements) -> None:
    """The file's stamp against its set's key; a field the file does not record is not checked. The
    interconnect only where the file measured more than one rank: a world of one moves nothing
    between GPUs."""
    stamp = measurements.stamp
    gpu, link = stamp.get("gpu") or {}, stamp.get("interconnect") or {}
    multi = any(world_size > 1 for _dtype, world_size, _profile in measurements.cells)
    for field, value in (("product", gpu.get("product")), ("capability", gpu.get("capability")),
                         ("interconnect", link.get("kind") if multi else None)):
        if value not in (None, "unknown") and value != declared.match[field]:
            raise ValueError(f"table_sets: {measurements.file}: {field} {value!r}, but the set {declared.name} "
                             f"is for {declared.match[field]!r}")


# ---- sets -------------------------------------------------------------------------------

def model_set() -> TableSet:
    boundaries = {(dtype, world_size, profile): tuning.model(world_size)
                  for dtype in spec.DTYPES for world_size in spec.WORLD_SIZES for profile in spec.OUTPUT_PROFILES}
    return TableSet(MODEL_NAME, "the written model (generator/tuning.py), for devices no set matches", None, (),
                    boundaries)


def fitted_cells(measured: dict) -> dict:
    """{(dtype, world size, profile): tuning.Boundaries} of every cell the measurements cover
    (`measured`: cell -> (file, points)), its own or a donor's: the other dtype's (same bytes an
    element), then the plain profile's (the same exchange); the cells nothing covers are left out."""
    boundaries = {}
    for dtype in spec.DTYPES:
        for world_size in spec.WORLD_SIZES:
            for profile in spec.OUTPUT_PROFILES:
                # Own measurements first, then the other dtype's, then the plain profile's.
                donors = [(donor_dtype, world_size, donor_profile) for donor_profile in (profile, spec.PLAIN)
                          for donor_dtype in (dtype, *spec.DTYPES)]
                donor = next((cell for cell in donors if cell in measured), None)
                if donor is None:
                    continue
                file, points = measured[donor]
                fitted = fit.fit_cell_by_hidden(points, tuning.model(world_size).limits, key=fit.FIT_KEY,
                                                elem_bytes=spec.DTYPE_BYTES[donor[0]],
                                                own_families=tuning.ladder_families(world_size))
                borrowed = [] if donor[0] == dtype else [f"{donor[0]} data"]
                borrowed += [] if donor[2] == profile else [f"profile {donor[2]}"]
                borrowed = f" ({', '.join(borrowed)})" if borrowed else ""
                boundaries[(dtype, world_size, profile)] = tuning.Boundaries(
                    fitted.limits, f"measured{borrowed} in {file}: {fitted.describe()}", fitted.key, fitted.measured,
                    fitted.by_hidden)
    return boundaries


def build_set(declared: Declared, files: list[Measurements]) -> TableSet:
    """Every cell of a set: fitted where its files measured it (or a donor cell), the model elsewhere."""
    measured: dict = {}
    for measurements in files:
        _check_stamp(declared, measurements)
        for cell, points in measurements.cells.items():
            if cell in measured:
                raise ValueError(f"table_sets: {declared.name}: {cell} measured in both {measured[cell][0]} and "
                                 f"{measurements.file}; a set takes each cell from one file")
            measured[cell] = (measurements.file, points)
    model, fitted = model_set().boundaries, fitted_cells(measured)
    boundaries = {cell: fitted.get(cell, model[cell]) for cell in model}
    return TableSet(declared.name, declared.title, dict(declared.match),
                    tuple({"file": m.file, "stamp": m.stamp} for m in files), boundaries)


def input_files(root: pathlib.Path) -> list[pathlib.Path]:
    """Every measurement file of the committed sets (generator inputs)."""
    return [pathlib.Path(root) / rel for declared in COMMITTED_SETS for rel in declared.files]


def table_sets(root: pathlib.Path | None = None) -> tuple[TableSet, ...]:
    """Every committed set, in COMMITTED_SETS order, then the written model."""
    root = pathlib.Path(root) if root is not None else pathlib.Path(__file__).resolve().parent.parent
    names = [declared.name for declared in COMMITTED_SETS]
    if len(set(names)) != len(names) or MODEL_NAME in names:
        raise ValueError(f"table_sets: set names must be unique and not {MODEL_NAME!r}: {names}")
    sets = [build_set(declared, [read_measurements(root, rel) for rel in declared.files])
            for declared in COMMITTED_SETS]
    return (*sets, model_set())


# ---- the key of fitted boundaries ---------------------------------------------------------------

def key_comparison(root: pathlib.Path, rel: str) -> str:
    """Markdown: every cell a file measured, fitted with each key (fit.KEYS) against the written
    model: the boundaries and the fit's error over all its points; then fitted on the shapes of
    hidden TARGET_SHAPE[0] alone and scored on the others (a hidden size it did not see)."""
    measurements = read_measurements(root, rel)
    lines = [f"Fitted to `{rel}` (every measured cell; boundaries as `gen-programs tables` shows them)\n",
             "| cell | key | boundaries | points over 1.05x (at the target shape) | worst | mean |",
             "|---|---|---|---:|---:|---:|"]
    held_out = ["", f"Fitted on hidden {fit.TARGET_SHAPE[0]} only, scored on the other hidden sizes\n",
                "| cell | key | points over 1.05x | worst | mean |", "|---|---|---:|---:|---:|"]
    for (dtype, world_size, profile), points in sorted(measurements.cells.items()):
        prior = tuning.model(world_size).limits
        for key in fit.KEYS:
            result = fit.fit_cell(points, prior, key=key, elem_bytes=spec.DTYPE_BYTES[dtype])
            # the rungs the cell's world size can run (world size 1: the local ones; else the exchanges)
            rungs = result.limits[:spec.LOCAL_RUNGS] if world_size == spec.LOCAL_WORLD_SIZE \
                else result.limits[spec.LOCAL_RUNGS:]
            shown = " / ".join(tuning.shown_limit(v, key) for v in rungs)
            lines.append(f"| {dtype} ws{world_size} {profile} | {key} | {shown} | {result.over} "
                         f"({result.over_at_target}) | {result.worst:.3f} | {result.mean:.4f} |")
            seen = {p: t for p, t in points.items() if p[0] == fit.TARGET_SHAPE[0]}
            unseen = {p: t for p, t in points.items() if p[0] != fit.TARGET_SHAPE[0]}
            if seen and unseen:
                limits = fit.fit_cell(seen, prior, key=key, elem_bytes=spec.DTYPE_BYTES[dtype]).limits
                slowdowns = [times[tuning.LADDER_FAMILIES[fit.rung_of(limits, fit.key_value(
                    key, p[3], p[0], spec.DTYPE_BYTES[dtype]))]].median_us / min(t.median_us for t in times.values())
                    for p, times in unseen.items()]
                held_out.append(f"| {dtype} ws{world_size} {profile} | {key} | "
                                f"{sum(s > fit.TARGET_SLOWDOWN for s in slowdowns)} of {len(slowdowns)} | "
                                f"{max(slowdowns):.3f} | "
                                f"{math.exp(sum(map(math.log, slowdowns)) / len(slowdowns)):.4f} |")
    return "\n".join(lines + held_out) + "\n"


if __name__ == "__main__":
    import sys
    print(key_comparison(pathlib.Path(__file__).resolve().parent.parent,
                         sys.argv[1] if len(sys.argv) > 1 else COMMITTED_SETS[0].files[0]), end="")
