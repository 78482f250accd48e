"""The results' format, for every world size: one record per system (one variant) at a point
(make_record, RECORD_KEYS first), the header every result starts with (header: the GPU, the
provenance stamp, the world), strict-JSON values, the files' writes (write_json whole or not at all;
write_report the table and the plot at the end) and the default file name."""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import re
from typing import Optional

from moe_ar_tools import provenance
from moe_ar_tools.bench.config import DTYPE_BYTES, PROFILES
from moe_ar_tools.bench.timing import median, percentile


RECORD_KEYS = ("system", "world_size", "emulated", "dtype", "hidden", "top_k", "shared", "profile",
               "tokens", "median_us", "roofline_us", "valid")
RATIO_KEYS = ("ratio_vs_nccl_torch", "ratio_vs_symm_torch", "ratio_vs_nccl_compiled", "ratio_vs_symm_compiled",
              "ratio_vs_best_baseline", "ratio_vs_best_program")


def make_record(*, system: str, world_size: int, dtype: str, hidden: int, top_k: int, shared: bool,
                profile: str, tokens: int, valid: bool, median_us: Optional[float] = None, replay_us=None,
                keep_replays: bool = False, roofline_us: Optional[float] = None, emulated: bool = False,
                profiles=PROFILES, **extra) -> dict:
    """One system at one point, required keys first (RECORD_KEYS), then its replay statistics, then
    the extras given. `replay_us`, its per-replay times (microseconds a call), give median_us, p10_us,
    p90_us and min_us (and stay in the record where keep_replays); else median_us is given (or None).
    `profiles`: the world size's profile names. Ratios (RATIO_KEYS) are time ratios, system /
    baseline, medians of per-replay pairs."""
    if not system or not isinstance(system, str):
        raise ValueError("record: system must be a non-empty string")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"record: dtype {dtype!r}")
    if profile not in profiles:
        raise ValueError(f"record: profile {profile!r}")
    for name, v in (("world_size", world_size), ("hidden", hidden), ("top_k", top_k), ("tokens", tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"record: {name} must be a positive int, got {v!r}")
    if replay_us is not None:
        if median_us is not None or not replay_us:
            raise ValueError("record: give median_us or a non-empty replay_us, not both")
        median_us = median(replay_us)
    if median_us is not None and not (isinstance(median_us, (int, float)) and median_us > 0):
        raise ValueError(f"record: median_us must be positive or None, got {median_us!r}")
    if valid and median_us is None:
        raise ValueError("record: a valid record needs median_us (or replay_us)")
    rec = {"system": system, "world_size": world_size, "emulated": bool(emulated), "dtype": dtype,
           "hidden": hidden, "top_k": top_k, "shared": bool(shared), "profile": profile, "tokens": tokens,
           "median_us": None if median_us is None else float(median_us),
           "roofline_us": None if roofline_us is None else float(roofline_us), "valid": bool(valid)}
    if replay_us:
        rec.update(p10_us=percentile(replay_us, 10), p90_us=percentile(replay_us, 90), min_us=min(replay_us))
    if keep_replays:
        rec["replay_us"] = list(replay_us or [])
    rec.update(extra)
    return rec


def run_header(*, gpu: str, world_size: int, dtype: str, l2_bytes: int, config: dict,
           when: Optional[datetime.datetime] = None) -> dict:
    """What every result starts with: the GPU, the provenance stamp (commit, date, driver, software
    versions), the world size, the dtype, the L2 bytes and the run's configuration."""
    return {"gpu": gpu, **provenance.stamp(when), "world_size": world_size, "dtype": dtype, "l2_bytes": l2_bytes,
            "config": config}


def jsonable(obj):
    """Non-finite floats (a NaN error from an unwritten output) become None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def write_json(path: pathlib.Path, obj) -> None:
    """`obj` as strict JSON at `path`, through a temporary file renamed over it: a run killed while
    writing leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(jsonable(obj), indent=1, allow_nan=False))
    os.replace(tmp, path)


def write_report(table_path: pathlib.Path, table: str, plot, result: dict, plot_path: pathlib.Path, log=print) -> None:
    """The final table at table_path, then plot(result, plot_path); a plot that fails is logged (the
    JSON is what matters)."""
    table_path.write_text(table)
    try:
        plot(result, plot_path)
        log(f"wrote {plot_path}")
    except Exception as e:  # noqa: BLE001 - the JSON is what matters
        log(f"plot failed: {type(e).__name__}: {e}")


def default_out_path(machine: str, when: datetime.datetime) -> pathlib.Path:
    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", machine).strip("_") or "machine"
    return pathlib.Path("bench_results") / f"{slug}-{when.strftime('%Y%m%d-%H%M%S')}.json"
