"""Test setup: import paths, seeds, GPU skipping, result records.

Seeds: one base seed per session (fresh unless --seed N or MOE_AR_SEED=N),
printed in the header; every test derives its seeds from (base seed, test id,
label), so `pytest --seed N path::test` reproduces a failure. Seeds a test used
are attached to its report.

GPU tests (marker `gpu`) skip when torch sees no CUDA device, when CuPy is not
installed, or when dispatch.gpu_available() is False. Any other failure to import
dispatch is NOT turned into a skip: it fails the tests.

MOE_AR_RESULTS=path: tests append one JSON line per summary through the
`record_result` fixture.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import secrets
import sys
import time

import pytest

# An emulated world of more than 8 ranks on one GPU has a stream per rank; with CUDA's default of 8
# hardware queues, calls launched rank by rank in bursts can queue one rank's next kernel in front of
# a peer's current one and deadlock (seen: world size 16). Read once, when CUDA starts.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

_BASE_SEED = None
_GPU_SKIP = "unset"


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="base seed for the moe_ar tests (default: MOE_AR_SEED or fresh)")


def pytest_configure(config):
    global _BASE_SEED
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the dispatch runtime")
    config.addinivalue_line("markers", "compile: compiles generated programs")
    s = config.getoption("--seed")
    if s is None and os.environ.get("MOE_AR_SEED"):
        s = int(os.environ["MOE_AR_SEED"])
    _BASE_SEED = s if s is not None else secrets.randbits(32)


def pytest_report_header(config):
    return f"moe_ar base seed: {_BASE_SEED} (reproduce with --seed {_BASE_SEED} or MOE_AR_SEED={_BASE_SEED})"


def gpu_skip_reason():
    """None when GPU tests can run, else why they are skipped (cached)."""
    global _GPU_SKIP
    if _GPU_SKIP != "unset":
        return _GPU_SKIP
    import torch
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device visible to torch"
    else:
        try:
            import dispatch
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "cupy":
                reason = f"CuPy not installed ({e})"
            else:
                raise
        else:
            if not dispatch.gpu_available():
                reason = "dispatch.gpu_available() is False (CuPy cannot reach a GPU)"
    _GPU_SKIP = reason
    return reason


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        reason = gpu_skip_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="session")
def base_seed():
    return _BASE_SEED


@pytest.fixture
def seed_for(request):
    """seed_for(label) -> int, a deterministic function of (base seed, test id, label)."""
    used = {}

    def derive(label="") -> int:
        h = hashlib.sha256(f"{_BASE_SEED}:{request.node.nodeid}:{label}".encode()).digest()
        s = int.from_bytes(h[:8], "little") >> 2
        used[str(label)] = s
        return s

    request.node._moe_ar_seeds = used
    return derive


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    seeds = getattr(item, "_moe_ar_seeds", None)
    if rep.when == "call" and rep.failed:
        rep.sections.append(("moe_ar seeds", f"base seed {_BASE_SEED} (rerun: --seed {_BASE_SEED}); "
                                             f"derived: {seeds or {}}"))


@pytest.fixture
def record_result(request):
    """record_result(**fields): append a JSON line to $MOE_AR_RESULTS (no-op when unset)."""
    path = os.environ.get("MOE_AR_RESULTS")

    def rec(**fields):
        if not path:
            return
        line = dict(test=request.node.nodeid, base_seed=_BASE_SEED, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        try:
            import torch
            if torch.cuda.is_available():
                line["gpu"] = torch.cuda.get_device_name(0)
                line["gpus"] = torch.cuda.device_count()
        except Exception:  # a record must never break a test
            pass
        line.update(fields)
        with open(path, "a") as f:
            f.write(json.dumps(line, sort_keys=True, default=str) + "\n")

    return rec


@pytest.fixture(scope="module")
def worlds():
    """gpu_worlds.Worlds: the last emulated world of a module, kept for its next test with the same key."""
    from gpu_worlds import Worlds
    w = Worlds()
    yield w
    w.close()


@pytest.fixture
def full_checks(monkeypatch):
    """[n]: how many calls took dispatch.op's full checks (a new plan) during the test."""
    from dispatch import op
    count = [0]
    real = op._full_checks

    def counting(ws, kwargs):
        count[0] += 1
        return real(ws, kwargs)

    monkeypatch.setattr(op, "_full_checks", counting)
    return count
