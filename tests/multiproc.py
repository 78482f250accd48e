"""Run a test module's worker function in several spawned processes, with a hang guard, and read back
the JSON rows each rank wrote (rank<N>.json in an output folder). Shared by the two-process tests."""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
import time

import pytest

# NVLink multicast can take a shared host's GPUs down: never in any process the tests start.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def spawn(module: str, fn_name: str, nprocs: int, args: tuple, timeout_s: float) -> None:
    """module.fn_name(rank, *args) in nprocs processes; fails the test if any raises, dies, or is still
    running after timeout_s (a hang), killing what is left."""
    import torch.multiprocessing as mp
    os.environ.update(ENV)
    here = str(pathlib.Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    fn = getattr(importlib.import_module(module), fn_name)  # picklable by this name
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):  # raises if a child raised or died
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(10)
            pytest.fail(f"{fn_name}: children still running after {timeout_s} s (a hang)")


def read_rank_rows(out_dir) -> list:
    """Every rank<N>.json list in out_dir, concatenated in rank order."""
    rows = []
    for p in sorted(pathlib.Path(out_dir).glob("rank*.json")):
        rows.extend(json.loads(p.read_text()))
    return rows


def expect_raise(fn, exc: type, starts: str, contains=(), bound_s: float = 20.0) -> tuple:
    """Call fn(), which must raise `exc` whose message starts with `starts` and holds every string of
    `contains`, within bound_s seconds. Returns (message or None, list of failures, seconds)."""
    t0 = time.monotonic()
    try:
        made = fn()
    except exc as e:
        msg, seconds = str(e), time.monotonic() - t0
        fails = [] if msg.startswith(starts) else [f"{msg!r} does not start with {starts!r}"]
        fails += [f"{msg!r} does not name {c!r}" for c in contains if c not in msg]
        if seconds > bound_s:
            fails.append(f"took {seconds:.1f} s to raise (bound {bound_s} s)")
        return msg, fails, seconds
    except Exception as e:
        got = f"expected {exc.__name__}({starts}...), got {type(e).__name__}: {e}"
        return None, [got[:1500]], time.monotonic() - t0
    seconds = time.monotonic() - t0
    if hasattr(made, "close"):  # a workspace built by mistake (on every rank alike): release it
        made.close()
    return None, [f"expected {exc.__name__}({starts}...), nothing raised"], seconds
