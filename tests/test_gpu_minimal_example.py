"""examples/minimal.py runs as README.md shows it: torchrun on 2 GPUs, every rank prints ok (its
fused call agrees with the torch computation). Needs 2 GPUs."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import multiproc

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_minimal_example_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    env = dict(os.environ, **multiproc.ENV, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "examples/minimal.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("rank ")) == ["rank 0: ok", "rank 1: ok"]
