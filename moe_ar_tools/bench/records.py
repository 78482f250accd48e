"""What the result JSON holds: one record per measured point (RECORD_KEYS first), strict-JSON
values, the default file name, and the software and driver versions of the run."""
from __future__ import annotations

import datetime
import math
import pathlib
import platform
import re
import subprocess
from typing import Optional

from moe_ar_tools.bench.config import DTYPE_BYTES, PROFILES


RECORD_KEYS = ("system", "world_size", "emulated", "dtype", "hidden", "top_k", "shared", "profile",
               "tokens", "median_us", "roofline_us", "valid")
RATIO_KEYS = ("ratio_vs_nccl_torch", "ratio_vs_symm_torch", "ratio_vs_nccl_compiled", "ratio_vs_symm_compiled",
              "ratio_vs_best_baseline", "ratio_vs_best_program")


def make_record(*, system: str, world_size: int, dtype: str, hidden: int, top_k: int, shared: bool,
                profile: str, tokens: int, median_us: Optional[float], roofline_us: float, valid: bool,
                emulated: bool = False, **extra) -> dict:
    """One measured point, required keys first (RECORD_KEYS), then the extras given.

    Ratios (RATIO_KEYS) are time ratios, system / baseline, medians of per-replay pairs."""
    if not system or not isinstance(system, str):
        raise ValueError("record: system must be a non-empty string")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"record: dtype {dtype!r}")
    if profile not in PROFILES:
        raise ValueError(f"record: profile {profile!r}")
    for name, v in (("world_size", world_size), ("hidden", hidden), ("top_k", top_k), ("tokens", tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"record: {name} must be a positive int, got {v!r}")
    if median_us is not None and not (isinstance(median_us, (int, float)) and median_us > 0):
        raise ValueError(f"record: median_us must be positive or None, got {median_us!r}")
    if valid and median_us is None:
        raise ValueError("record: a valid record needs median_us")
    rec = {"system": system, "world_size": world_size, "emulated": bool(emulated), "dtype": dtype,
           "hidden": hidden, "top_k": top_k, "shared": bool(shared), "profile": profile, "tokens": tokens,
           "median_us": None if median_us is None else float(median_us), "roofline_us": float(roofline_us),
           "valid": bool(valid)}
    rec.update(extra)
    return rec


def jsonable(obj):
    """Non-finite floats (a NaN error from an unwritten output) become None: strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def default_out_path(machine: str, when: datetime.datetime) -> pathlib.Path:
    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", machine).strip("_") or "machine"
    return pathlib.Path("bench_results") / f"{slug}-{when.strftime('%Y%m%d-%H%M%S')}.json"


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from cupy.cuda import runtime
        v = runtime.driverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - metadata only
        return "unknown"


def _versions() -> dict:
    import torch
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    try:
        import cupy
        versions["cupy"] = cupy.__version__
    except ImportError:
        versions["cupy"] = None
    try:
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - metadata only
        versions["nccl"] = None
    return versions
