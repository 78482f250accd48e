"""The world-size-1 benchmark's former command, kept for the command lines of earlier results:
`python -m moe_ar_tools.bench_one ARGS` (moe-ar-bench-one) is `python -m moe_ar_tools.bench --world 1
ARGS`, the one harness (moe_ar_tools/bench/, its world-size-1 plugin world_one/)."""
from __future__ import annotations

import sys


def main(args=None) -> None:
    from moe_ar_tools.bench.cli import main as bench
    bench(args=["--world", "1", *(sys.argv[1:] if args is None else args)],
          prog_name="python -m moe_ar_tools.bench_one")
