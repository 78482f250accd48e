"""Where a result came from, one stamp for every tool: the repository root, the commit, the software
versions, the driver, and stamp(), the fields every result's header starts with (the bench, the
soak, the backend and host-time measurements; stamp.py adds the machine key of a table set)."""
from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """MOE_AR_COMMIT when set (the device machine's copy may carry a stale .git), else git's HEAD,
    else "unknown"."""
    if os.environ.get("MOE_AR_COMMIT"):
        return os.environ["MOE_AR_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def versions() -> dict:
    """torch and its CUDA, Python, and CuPy, NCCL and Triton where present (None where not)."""
    import torch
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for name in ("cupy", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - metadata only
        out["nccl"] = None
    return out


def nvml_module():
    """pynvml where installed, else the driver's NVML through ctypes, else None."""
    try:
        import pynvml
        return pynvml
    except ImportError:
        from dispatch import gpu_facts
        return gpu_facts.nvml_library()


def _nvml_driver(nvml) -> str | None:
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver library to ask
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _tools_driver() -> str | None:
    """nvidia-smi's driver version, else the CUDA driver API's through CuPy (0 there: no driver)."""
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
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}" if v else None
    except Exception:  # noqa: BLE001 - metadata only
        return None


def driver_version(nvml="default") -> str:
    """The driver's version: NVML's (`nvml`: an NVML interface, "default" finds one, None: none), else
    nvidia-smi's, else the CUDA driver API's, else "unknown"."""
    if nvml == "default":
        nvml = nvml_module()
    found = _nvml_driver(nvml) if nvml is not None else None
    return found or _tools_driver() or "unknown"


def stamp(when: datetime.datetime | None = None) -> dict:
    """The fields a result's header starts with: commit, date, driver and software versions."""
    when = when or datetime.datetime.now()
    return {"commit": git_commit(), "date": when.isoformat(timespec="seconds"), "driver": driver_version(),
            "versions": versions()}
