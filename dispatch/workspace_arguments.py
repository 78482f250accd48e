"""A workspace's arguments, checked before any collective or allocation: types, ranges and the
manifest's limits. Every bad argument is a ValueError naming it."""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from . import registry
from .workspace_sizes import MAX_TOKENS

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
BACKENDS = ("ipc", "symm_mem", "auto")
# The largest deadline: the kernel adds timeout_ns to %globaltimer (ns; since 1970 on current drivers,
# about 2^61) in a uint64, which one day (8.64e13 ns) keeps far from 2^64 whatever the timer's origin;
# a wait on a peer longer than a day is a hang in all but name.
MAX_TIMEOUT_S = 86400


def _int_arg(name: str, value, lo: int, hi: int | None = None, what: str = "") -> int:
    """An int argument (a Python or NumPy integer, never a bool or a float) within lo..hi."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: {value!r} ({type(value).__name__}) is not an int{what}")
    v = operator.index(value)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}: {v} is out of range, expected {lo}..{'' if hi is None else hi}{what}")
    return v


def timeout_ns_from(timeout_s) -> int:
    """The deadline in ns; a positive timeout is at least 1 ns (0 means no deadline)."""
    return max(1, round(float(timeout_s) * 1e9)) if timeout_s else 0


def check_workspace_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread) -> None:
    """Every argument check that needs no GPU (and no collective): types, ranges, the manifest's limits.
    ValueError naming the argument."""
    ps = registry.program_set()
    limits = ps.limits
    generated = ps.manifest["axes"]["world_sizes"]
    _int_arg("world_size", world_size, 1)
    if world_size not in generated:
        raise ValueError(f"world_size: {world_size} is not generated (have {generated})")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported (use torch.float16 or torch.bfloat16)")
    _int_arg("max_tokens", max_tokens, 1, MAX_TOKENS, " (the kernel's 32-bit counts)")
    hidden = _int_arg("hidden", hidden, 16, limits["max_hidden"],
                      f" (a positive multiple of 16, at most {limits['max_hidden']})")
    if hidden % 16:
        raise ValueError(f"hidden: {hidden} is not a multiple of 16")
    if (isinstance(timeout_s, (bool, np.bool_)) or not isinstance(timeout_s, numbers.Real)
            or not math.isfinite(timeout_s) or not 0 <= timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s: {timeout_s!r}, expected a finite number of seconds in 0..{MAX_TIMEOUT_S} "
                         f"(0 disables the deadline)")
    if oneshot_max_tokens is not None:
        _int_arg("oneshot_max_tokens", oneshot_max_tokens, 1, max_tokens, " (1..max_tokens, or None)")
    if vec_per_thread is not None:
        _int_arg("vec_per_thread", vec_per_thread, 1, limits["max_vec_per_thread"], " (or None)")


def check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected 'ipc', 'symm_mem' or 'auto'")
    return backend


def device_entry(device, name: str) -> int | None:
    """The GPU index one argument names: an int, "cuda:i" or torch.device("cuda", i); None for None or
    a CUDA device without an index (the current device, resolved by the caller). ValueError naming
    `name` for anything else or a GPU that is not visible."""
    if isinstance(device, (str, torch.device)):
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"{name}: {device!r} is not a device") from None
        if dev.type != "cuda":
            raise ValueError(f"{name}: {device!r} is not a CUDA device")
        index = dev.index
    elif device is None:
        index = None
    elif isinstance(device, (bool, np.bool_)) or not isinstance(device, numbers.Integral):
        raise ValueError(f"{name}: {device!r} ({type(device).__name__}) is not a GPU index, a CUDA device or None")
    else:
        index = operator.index(device)
    count = torch.cuda.device_count()
    if index is not None and not 0 <= index < count:
        raise ValueError(f"{name}: GPU {index} does not exist ({count} visible)")
    return index


def check_devices(devices, world_size) -> list:
    """EmulatedWorld's `devices`: W GPU indices (ints, "cuda:i" or torch.device("cuda", i)); None entries
    stand for the current device (resolved later). Needs no GPU."""
    if devices is None:
        return [None] * world_size
    if isinstance(devices, (str, bytes, torch.device)) or not hasattr(devices, "__len__"):
        raise ValueError(f"devices: expected a list of {world_size} GPU indices, got {type(devices).__name__}")
    devices = list(devices)
    if len(devices) != world_size:
        raise ValueError(f"devices: {len(devices)} entries for world_size {world_size}")
    if any(d is None for d in devices):  # None stands for the whole list (devices=None), not an entry
        raise ValueError("devices: entry None (NoneType) is not a GPU index; devices=None puts every rank on the "
                         "current device")
    return [device_entry(d, "devices") for d in devices]
