"""The tune loop: unit after unit until every unit is done or the time budget is spent; the output
file rewritten after each, so that a run stopped part-way (budget, Ctrl-C, a lost machine) resumes
from it. `measure(unit)` runs one unit on every rank and returns each rank's replay times; the
loop keeps, per replay, the slowest rank's (every rank of a call waits for the slowest, and every
rank must fit the same table)."""
from __future__ import annotations

import pathlib
import statistics
import sys
import time

from moe_ar_tools.bench.timing import percentile

from . import output


_percentile = percentile  # the benchmark's (moe_ar_tools/bench/timing.py), one definition


def combine_ranks(per_rank: list) -> dict:
    """per_rank[r] = {program: {"replay_us": [us a call, per replay], "reasons": [why it is not valid]}}
    -> {program: {median_us, p10_us, p90_us, noise_us, replays, valid, reasons}}: per replay the slowest
    rank's time, then the median and the spread of those (noise: half the 10th-90th percentile
    spread). A program is valid when it matched the reference on every rank; one that did not run
    everywhere has no time."""
    programs = sorted(set().union(*(set(rank) for rank in per_rank)))
    out = {}
    for program in programs:
        mine = [rank.get(program) for rank in per_rank]
        reasons = [f"rank {r}: {why}" for r, got in enumerate(mine) for why in (got or {}).get("reasons", [])]
        reasons += [f"rank {r}: not measured" for r, got in enumerate(mine) if got is None]
        series = [got["replay_us"] for got in mine if got is not None]
        if len(series) < len(per_rank) or not all(series) or len({len(s) for s in series}) != 1:
            out[program] = {"median_us": None, "p10_us": None, "p90_us": None, "noise_us": None, "replays": 0,
                            "valid": False, "reasons": reasons or ["no replay times on some rank"]}
            continue
        slowest = [max(replay) for replay in zip(*series)]
        p10, p90 = _percentile(slowest, 10), _percentile(slowest, 90)
        out[program] = {"median_us": statistics.median(slowest), "p10_us": p10, "p90_us": p90,
                        "noise_us": (p90 - p10) / 2, "replays": len(slowest), "valid": not reasons,
                        "reasons": reasons}
    return out


def records_for(unit, combined: dict) -> list:
    """The output records of one unit: one per program, the cell (family, dtype, world size,
    profile) from its name."""
    from generator import spec
    records = []
    for program, got in combined.items():
        cell = spec.parse(program)
        if (cell.dtype, cell.world_size, cell.profile) != (unit.dtype, unit.world_size, unit.profile):
            raise ValueError(f"measure: {program} is not a program of the unit {unit.label}")
        records.append({"program": program, "family": cell.family, "dtype": unit.dtype, "world_size": unit.world_size,
                        "profile": unit.profile, "hidden": unit.hidden, "top_k": unit.top_k, "shared": unit.shared,
                        "tokens": unit.tokens, **got})
    return records


class Progress:
    """A progress bar with the time left, on stderr (a line per unit where stderr is no terminal)."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width

    def __call__(self, done: int, total: int, label: str, seconds_left: float | None) -> None:
        filled = self.width * done // max(total, 1)
        left = "?" if seconds_left is None else _duration(seconds_left)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {label}, {left} left"
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(("\r" + line.ljust(100)) if tty else line + "\n")
        if tty and done == total:
            self.stream.write("\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def run(units: list, measure, out: pathlib.Path, *, name: str, stamp: dict, config: dict, deadline: float,
        clock=time.monotonic, progress=None) -> dict:
    """Measure every unit not done yet in `out` (created, or resumed when its stamp is this machine's
    and its programs these), until `deadline` (of `clock`) would pass before the next unit ends, by
    the mean time of the units measured so far. Returns the output document, also written to `out`."""
    out = pathlib.Path(out)
    doc = output.load(out)
    if doc is None:
        doc = output.new_document(name, stamp, config)
    else:
        why = output.resume_refused(doc, stamp)
        if why is not None:
            raise ValueError(f"out: {out} holds an earlier tune that cannot be resumed here: {why}; give another "
                             f"--out or remove it")
    done = {tuple(key) for key in doc["done"]}
    todo = [unit for unit in units if tuple(unit.key) not in done]
    total, finished = len(units), len(units) - len(todo)
    took = []
    doc["truncated"] = False
    for i, unit in enumerate(todo):
        start = clock()
        mean = sum(took) / len(took) if took else 0.0
        if start + mean > deadline:
            doc["truncated"] = True
            break
        records = records_for(unit, combine_ranks(measure(unit)))
        output.add(doc, unit, records)
        output.refit(doc, out.name)
        took.append(clock() - start)
        doc["complete"] = finished + i + 1 == total
        output.write(out, doc)
        if progress is not None:
            left = len(todo) - i - 1
            progress(finished + i + 1, total, unit.label, sum(took) / len(took) * left)
    doc["complete"] = {tuple(key) for key in doc["done"]} >= {tuple(unit.key) for unit in units}
    output.write(out, doc)
    return doc
