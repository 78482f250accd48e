"""World size 1: the latency program's cluster layout past 16 tokens. The world-size-1 bench (ours
against Triton, the automatic choice, outputs checked) run in one process with the manifest's
cluster_max_tokens at 16 (committed), at $CLUSTER_MAX, then at 16 again (A/B/A).

    PYTHONPATH=. OUT=DIR CLUSTER_MAX=64 python experiments/world_size_1/cluster/more_tokens.py
"""
from __future__ import annotations

import os
import pathlib

from dispatch import registry
from moe_ar_tools.bench.cli import main

out = pathlib.Path(os.environ["OUT"])
limits = registry.program_set().limits
committed = limits["cluster_max_tokens"]
for i, cmax in enumerate((committed, int(os.environ.get("CLUSTER_MAX", 64)), committed)):
    limits["cluster_max_tokens"] = cmax
    main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", os.environ.get("TOK", "17,24,32,48,64,96,128"),
          "--profiles", "plain,fp8_group128_row,fp8_tensor,nvfp4", "--systems",
          "ours,triton_fused" if i == 0 else "ours", "--compile-modes", "dynamic", "--static-compile-shapes", "",
          "--no-programs", "--budget-s", "120", "--out", str(out / f"run{i}-cluster{cmax}")], standalone_mode=False)
