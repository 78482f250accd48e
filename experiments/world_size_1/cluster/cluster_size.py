"""World size 1, 48 to 146 tokens: the latency program's cluster layout with fewer, larger blocks a
token. The world-size-1 bench (ours against Triton, the automatic choice, outputs checked) in one
process under the committed limits, then with the manifest's cluster_max_tokens at 146 and
cluster_max_blocks at 2 (two blocks of 7 warps a token at H 7168) and at 7 (the committed split's 7
blocks of 2 warps), then the committed limits again.

    PYTHONPATH=. OUT=DIR python experiments/world_size_1/cluster/cluster_size.py
"""
from __future__ import annotations

import os
import pathlib

from dispatch import registry
from moe_ar_tools.bench.cli import main

out = pathlib.Path(os.environ["OUT"])
limits = registry.program_set().limits
committed = (limits["cluster_max_tokens"], limits["cluster_max_blocks"])
for i, (tokens, blocks) in enumerate((committed, (146, 2), (146, 7), committed)):
    limits["cluster_max_tokens"], limits["cluster_max_blocks"] = tokens, blocks
    main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", os.environ.get("TOK", "32,48,64,96,128,146"),
          "--profiles", "plain,fp8_group128_row,fp8_tensor,nvfp4", "--systems",
          "ours,triton_fused" if i == 0 else "ours", "--compile-modes", "dynamic", "--static-compile-shapes", "",
          "--no-programs", "--budget-s", "120", "--out", str(out / f"run{i}-cluster{tokens}-blocks{blocks}")],
         standalone_mode=False)
