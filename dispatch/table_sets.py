"""Which selection boundaries a workspace uses: the table set for its device, a user's own set, a
per-workspace override. Chosen once, when the workspace is built; a call only reads the result.

The manifest lists the committed sets (`selection.sets`: each keyed by GPU product, compute
capability and interconnect, with every cell) and the written model (the set whose `match` is
null). For a device the runtime takes, per workspace:

1. a user's own set (the `tables=` argument of the workspace, else $MOE_AR_TABLES): a file written by
   `gen-programs tune`, made for these programs (manifest sha256) on a device like this one (GPU
   product, compute capability, SM count, interconnect). A set that does not match is refused with
   one warning naming the mismatch and not used at all. It serves the cells it measured;
2. else, and for the cells it lacks, the committed set of the exact product, then of the same
   compute capability and interconnect (the first listed), then the written model.
At world size 1 the interconnect is not compared (nothing is exchanged).

A fitted cell covers its measured range only (in tokens for the workspace's hidden size and dtype):
below it a call runs no later rung than the range's first, above it no earlier than its last, and
otherwise what the next set of the chain runs; a table is never stretched past what it measured.
`boundaries=` then pins fields by hand (tokens, every output profile), the others clamped to keep
the ladder in order. The choice is logged once (logger "moe_ar.tables", INFO) and
`selection_info(workspace)` answers with the set and each cell's source. The device's key (product,
capability, SM count, interconnect) comes from gpu_facts.py, which probes the machine.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import threading
import warnings

from . import gpu_facts, registry
from .gpu_facts import DeviceKey

ENV_VAR = "MOE_AR_TABLES"


def tune_format() -> tuple:
    """(format, version) of the file `gen-programs tune` writes: the manifest's (generator/table_sets.py)."""
    tune_file = registry.program_set().manifest["selection"]["tune_file"]
    return tune_file["format"], tune_file["version"]


def keys() -> frozenset:
    """What a cell's boundaries may count (tokens, or bytes a rank): the manifest's selection keys."""
    return frozenset(registry.program_set().manifest["selection"]["keys"])


log = logging.getLogger("moe_ar.tables")
_said = set()       # log lines and warnings already given in this process
_said_lock = threading.Lock()


def _once(kind: str, text: str) -> None:
    """Log (kind "log") or warn (kind "warn", RuntimeWarning) `text` the first time only."""
    with _said_lock:
        if (kind, text) in _said:
            return
        _said.add((kind, text))
    if kind == "log":
        log.info(text)
    else:
        warnings.warn(text, RuntimeWarning, stacklevel=4)


# ---- sets -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    key: str
    limits: tuple[int, ...]               # per ladder field, in `key` units
    measured: tuple[int, int] | None      # the key's measured range; None: the written model
    source: str
    # hidden -> (limits, measured range) of its own, in the same key
    by_hidden: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TableSet:
    name: str
    match: dict | None                    # product, capability, interconnect (a user's set: sm_count too)
    cells: dict                           # (dtype, world_size, profile) -> Cell
    origin: str                           # "committed", or the file a user's set came from


def _ladder(limits: tuple, all_tokens: int) -> bool:
    """Boundaries of a ladder: ints, 0 <= each <= the next <= all_tokens."""
    return (all(type(v) is int for v in limits) and 0 <= limits[0]
            and all(a <= b <= all_tokens for a, b in zip(limits, limits[1:])))


def _range(measured: tuple) -> bool:
    """A measured range: two ints, 0 <= low <= high."""
    return len(measured) == 2 and all(type(v) is int for v in measured) and 0 <= measured[0] <= measured[1]


def _cells(rows, fields: tuple, all_tokens: int, where: str) -> dict:
    """(dtype, world_size, profile) -> Cell from a set's rows (the manifest's or a user's file);
    ValueError naming `where` for a row that is not one."""
    cells = {}
    try:
        for row in rows:
            limits = tuple(row["limits"][field] for field in fields)
            measured = None if row["measured"] is None else tuple(row["measured"])
            by_hidden = {int(hidden): (tuple(own["limits"][field] for field in fields), tuple(own["measured"]))
                         for hidden, own in row.get("by_hidden", {}).items()}
            ok = (row["key"] in keys() and _ladder(limits, all_tokens) and (measured is None or _range(measured))
                  and all(hidden > 0 and _ladder(own, all_tokens) and _range(own_measured)
                          for hidden, (own, own_measured) in by_hidden.items()))
            if not ok:
                raise ValueError(f"row {row!r}")
            cells[(row["dtype"], row["world_size"], row["profile"])] = Cell(row["key"], limits, measured,
                                                                           str(row["source"]), by_hidden)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a table set's boundaries ({type(e).__name__}: {e}); "
                         f"fields {list(fields)}") from None
    return cells


@functools.lru_cache(maxsize=None)
def committed_sets() -> tuple[tuple[TableSet, ...], TableSet]:
    """(the committed sets in the manifest's order, the written model)."""
    program_set = registry.program_set()
    selection = program_set.manifest["selection"]
    fields = ladder_fields()
    sets = [TableSet(s["name"], s["match"], _cells(s["boundaries"], fields, program_set.all_tokens, "manifest"),
                     "committed") for s in selection["sets"]]
    models = [s for s in sets if s.match is None]
    if len(models) != 1:
        raise ValueError(f"manifest: {len(models)} sets without a match (the written model); need one")
    return tuple(s for s in sets if s.match is not None), models[0]


def ladder_fields() -> tuple[str, ...]:
    return tuple(field for _regime, field in registry.program_set().ladder if field is not None)


def match_level(match: dict, device: DeviceKey) -> int | None:
    """2: the exact product, 1: the same compute capability and interconnect, None: neither. An
    unknown interconnect (no NVML) is not held against a set."""
    if match["capability"] != device.capability:
        return None
    if device.interconnect != "unknown" and match["interconnect"] != device.interconnect:
        return None
    return 2 if match["product"] == device.product else 1


def committed_for(device: DeviceKey) -> tuple[TableSet, str]:
    """The committed set for a device and why: the exact product first, then the first set of the same
    compute capability and interconnect, else the written model."""
    sets, model = committed_sets()
    levels = [(match_level(s.match, device), -i, s) for i, s in enumerate(sets)]
    found = max((x for x in levels if x[0] is not None), default=None, key=lambda x: x[:2])
    if found is None:
        return model, "no committed set matches"
    return found[2], "exact product" if found[0] == 2 else "same compute capability and interconnect"


# ---- a user's own set -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class UserSet:
    table_set: TableSet
    program_set_sha256: str


def read_user_set(path, argument: str) -> UserSet:
    """A `gen-programs tune` output file; ValueError naming `argument` where it cannot be read as one."""
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{argument}: cannot read a table set from {str(path)!r} ({type(e).__name__}: {e})") from None
    tune_format_name, tune_version = tune_format()
    if not isinstance(doc, dict) or doc.get("format") != tune_format_name or doc.get("version") != tune_version:
        raise ValueError(f"{argument}: {str(path)!r} is not a table set of format {tune_format_name!r} version "
                         f"{tune_version} (written by `gen-programs tune`)")
    try:
        found = doc["set"]
        match, name, sha = found["match"], str(found["name"]), str(found["program_set_sha256"])
        for field in ("product", "capability", "sm_count", "interconnect"):
            match[field]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{argument}: {str(path)!r} has no complete `set` ({type(e).__name__}: {e})") from None
    cells = _cells(found.get("boundaries"), ladder_fields(), registry.program_set().all_tokens,
                   f"{argument}: {str(path)!r}")
    return UserSet(TableSet(name, dict(match), cells, str(path)), sha)


def user_set_mismatch(user: UserSet, device: DeviceKey, program_set_sha256: str) -> str | None:
    """Why a user's set may not be used on this device with these programs; None when it may."""
    if user.program_set_sha256 != program_set_sha256:
        return (f"it was measured with other programs (manifest sha256 {user.program_set_sha256[:16]}..., these are "
                f"{program_set_sha256[:16]}...); run `gen-programs tune` again")
    match = user.table_set.match
    for field, mine in (("product", device.product), ("capability", device.capability),
                        ("sm_count", device.sm_count), ("interconnect", device.interconnect)):
        theirs = match.get(field)
        if field == "interconnect" and mine == "unknown":
            continue  # nothing to compare with (no NVML)
        if theirs != mine:
            return f"it was measured on {field} {theirs!r}, this device has {mine!r}"
    return None


# ---- boundaries in tokens ---------------------------------------------------------------------

def rung_of(limits, tokens: int) -> int:
    """The ladder index of the rung that serves `tokens`: the first whose limit it does not exceed."""
    return next((i for i, limit in enumerate(limits) if tokens <= limit), len(limits))


def token_cell(cell: Cell, hidden: int, elem_bytes: int, all_tokens: int) -> tuple[tuple, tuple | None]:
    """(limits, measured range) of a cell in tokens for a row of `hidden` elements of `elem_bytes`:
    the hidden size's own boundaries where the cell has them, else the cell's."""
    own, own_measured = cell.by_hidden.get(hidden, (cell.limits, cell.measured))
    if cell.key == "tokens":
        return own, own_measured
    row = hidden * elem_bytes  # bytes_per_rank = T x row
    limits = tuple(v if v == all_tokens else v // row for v in own)
    measured = None if own_measured is None else (-(-own_measured[0] // row), own_measured[1] // row)
    return limits, measured


def compose(limits: tuple, measured: tuple | None, fallback: tuple, all_tokens: int) -> tuple:
    """Boundaries (tokens) that run `limits` over the measured range, and outside it what `fallback`
    runs, never going back down the ladder: below the range no later rung than at its start, above it
    no earlier rung than at its end. A range holding no token count: `fallback` throughout."""
    if measured is None:
        return tuple(limits)
    low, high = measured
    if low > high:
        return tuple(fallback)

    def rung(tokens: int) -> int:
        if tokens < low:
            return min(rung_of(limits, low), rung_of(fallback, tokens))
        if tokens > high:
            return max(rung_of(limits, high), rung_of(fallback, tokens))
        return rung_of(limits, tokens)

    # The rung changes only after a limit of either table or at the range's ends: a boundary is one of these.
    candidates = {v for v in (0, all_tokens, low - 1, high, *limits, *fallback) if 0 <= v <= all_tokens}
    return tuple(max((v for v in candidates if rung(v) <= i), default=0) for i in range(len(limits)))


def check_boundaries(boundaries, fields: tuple, all_tokens: int) -> dict:
    """The `boundaries=` override: {field: tokens} of known ladder fields, ints in 0..all_tokens, in
    ladder order non-decreasing. ValueError naming the argument."""
    if boundaries is None:
        return {}
    if not isinstance(boundaries, dict):
        raise ValueError(f"boundaries: expected a dict of ladder fields to token counts, got {type(boundaries).__name__}")
    for field, value in boundaries.items():
        if field not in fields:
            raise ValueError(f"boundaries: unknown field {field!r} (the ladder's fields: {', '.join(fields)})")
        if type(value) is not int or not 0 <= value <= all_tokens:
            raise ValueError(f"boundaries: {field} = {value!r}, expected an int token count in 0..{all_tokens}")
    pinned = [(field, boundaries[field]) for field in fields if field in boundaries]
    for (a, x), (b, y) in zip(pinned, pinned[1:]):
        if x > y:
            raise ValueError(f"boundaries: {a} = {x} > {b} = {y}; the ladder's boundaries must not decrease")
    return dict(pinned)


def pin(limits: tuple, pinned: dict, fields: tuple) -> tuple:
    """`limits` with the pinned fields set, the others clamped between their pinned neighbours."""
    out = [pinned.get(field, limit) for field, limit in zip(fields, limits)]
    for i in range(1, len(out)):
        if fields[i] not in pinned:
            out[i] = max(out[i], out[i - 1])
    for i in range(len(out) - 2, -1, -1):
        if fields[i] not in pinned:
            out[i] = min(out[i], out[i + 1])
    return tuple(out)


# ---- a workspace's selection ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CellChoice:
    limits: tuple[int, ...]   # tokens, per ladder field
    set: str                  # the set it came from
    source: str


@dataclasses.dataclass(frozen=True)
class Selection:
    """The boundaries a workspace's calls use, per output profile, in tokens."""
    device: DeviceKey
    set: str                  # the set that serves the workspace (a user's, a committed one, the model)
    why: str
    fields: tuple[str, ...]
    cells: dict               # profile -> CellChoice
    pinned: dict
    user_set: str | None = None   # the user's file where one was given and used

    def limits(self, profile: str) -> dict:
        """{field: tokens} of a profile's cell; ValueError where no table has the cell."""
        try:
            return dict(zip(self.fields, self.cells[profile].limits))
        except KeyError:
            raise ValueError(f"quant: no selection table holds output profile {profile!r} for this workspace") from None

    def oneshot_capacity(self, oneshot_field: str) -> int:
        """The largest one-shot boundary of any profile (at least 1): no automatic call runs the
        one-shot above it."""
        i = self.fields.index(oneshot_field)
        return max([1] + [cell.limits[i] for cell in self.cells.values()])

    @property
    def label(self) -> str:
        """The set and a digest of every boundary: what the ranks of a group must agree on."""
        text = json.dumps([self.fields, sorted((p, c.limits) for p, c in self.cells.items())])
        return f"{self.set} {hashlib.sha256(text.encode()).hexdigest()[:12]}"


def resolve(*, dtype: str, world_size: int, hidden: int, elem_bytes: int, device: DeviceKey,
            user: UserSet | None, program_set_sha256: str, boundaries=None, where: str = "tables") -> Selection:
    """The selection of a workspace of (dtype, world size, hidden) on `device` (module doc). A user's
    set that does not match is refused with one warning and not used."""
    program_set = registry.program_set()
    all_tokens = program_set.all_tokens
    fields = ladder_fields()
    pinned = check_boundaries(boundaries, fields, all_tokens)
    # A world of one exchanges nothing: the interconnect does not decide its tables (its cells were
    # measured on one GPU, whatever NVML said of its links).
    matched = device if world_size != 1 else dataclasses.replace(device, interconnect="unknown")
    committed, why = committed_for(matched)
    _, model = committed_sets()
    if user is not None:
        mismatch = user_set_mismatch(user, matched, program_set_sha256)
        if mismatch is not None:
            _once("warn", f"{where}: the table set {user.table_set.name!r} from {user.table_set.origin} is not used: "
                          f"{mismatch}")
            user = None
    cells = {}
    for (cell_dtype, cell_world, profile), model_cell in model.cells.items():
        if (cell_dtype, cell_world) != (dtype, world_size):
            continue
        limits, chosen, source = model_cell.limits, model.name, model_cell.source
        for table_set in ([committed] if committed is not model else []) + ([user.table_set] if user else []):
            cell = table_set.cells.get((dtype, world_size, profile))
            if cell is None:
                continue
            own, measured = token_cell(cell, hidden, elem_bytes, all_tokens)
            limits = compose(own, measured, limits, all_tokens)
            outside = "" if measured is None else f"; T outside {measured[0]}..{measured[1]} from {chosen}"
            mine = f"; this hidden size's own boundaries ({hidden})" if hidden in cell.by_hidden else ""
            chosen, source = table_set.name, cell.source + mine + outside
        if pinned:
            limits = pin(limits, pinned, fields)
            source += f"; pinned by boundaries= ({', '.join(f'{k} {v}' for k, v in pinned.items())})"
        cells[profile] = CellChoice(tuple(limits), chosen, source)
    if user is not None:
        return Selection(device, user.table_set.name, f"a user's set ({user.table_set.origin})", fields, cells,
                         pinned, user.table_set.origin)
    return Selection(device, committed.name, why, fields, cells, pinned)


def _program_set_sha256() -> str:
    from .rendezvous import program_set_sha256
    return program_set_sha256()


def _user_set(tables) -> tuple[UserSet | None, str]:
    """The user's set of the `tables` argument, else of $MOE_AR_TABLES, else None; ValueError naming
    the argument (or the variable) where it cannot be read."""
    where = "tables"
    if tables is None and os.environ.get(ENV_VAR):
        tables, where = os.environ[ENV_VAR], ENV_VAR
    if tables is None:
        return None, where
    if not isinstance(tables, (str, os.PathLike)):
        raise ValueError(f"tables: expected a path to a table set file (or None), got {type(tables).__name__}")
    return read_user_set(tables, where), where


def check_arguments(tables, boundaries) -> None:
    """The workspace's `tables` and `boundaries`, checked without a GPU (ValueError naming them)."""
    check_boundaries(boundaries, ladder_fields(), registry.program_set().all_tokens)
    _user_set(tables)


def for_workspace(dtype: str, world_size: int, hidden: int, elem_bytes: int, device_index: int,
                  tables=None, boundaries=None) -> Selection:
    """A workspace's selection: its device's key, the user's set (`tables`, else $MOE_AR_TABLES), the
    override; the choice logged once per process."""
    user, where = _user_set(tables)
    selection = resolve(dtype=dtype, world_size=world_size, hidden=hidden, elem_bytes=elem_bytes,
                        device=gpu_facts.describe_device(device_index), user=user,
                        program_set_sha256=_program_set_sha256(), boundaries=boundaries, where=where)
    pinned = f", boundaries pinned: {selection.pinned}" if selection.pinned else ""
    _once("log", f"moe_ar tables: {selection.device.describe()}: set {selection.set} ({selection.why}) for "
                 f"{dtype} world size {world_size}{pinned}")
    return selection


def selection_info(workspace) -> dict:
    """The set a workspace (or an EmulatedWorld: its rank 0) selects with, why, and each output
    profile's boundaries in tokens with the set and source of the cell."""
    ws = workspace.workspaces[0] if hasattr(workspace, "workspaces") else workspace
    selection = getattr(ws, "selection", None)
    if not isinstance(selection, Selection):
        raise ValueError(f"workspace: expected a Workspace or EmulatedWorld, got {type(workspace).__name__}")
    return {
        "set": selection.set,
        "why": selection.why,
        "device": dataclasses.asdict(selection.device),
        "user_set": selection.user_set,
        "pinned": dict(selection.pinned),
        "cells": {profile: {"boundaries": dict(zip(selection.fields, cell.limits)), "set": cell.set,
                            "source": cell.source}
                  for profile, cell in selection.cells.items()},
    }
