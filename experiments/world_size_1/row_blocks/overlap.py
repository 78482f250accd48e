"""The third row_blocks run: does a second resident block (the loads of one token under the
epilogue of another) close the gap, and what does the sum of squares itself cost? Kernels of
variants.patch: a token over a cluster of C = 2 or 4 blocks, so that a block is small enough for
2-4 to be resident at 128-235 registers; variant bit 8: the epilogue without the sum of squares
(timing only, norm_out's scale is eps). Same command as variants.py, with overlap.py."""
from __future__ import annotations

import importlib.util
import pathlib


HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("row_blocks_variants", HERE / "variants.py")
v = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v)
sp, rb = v.sp, v.rb

# (C, (profile, vec, launch-bound threads, min blocks, variant))
SYSTEMS = [(1, ("plain", 2, 512, 1, 0)), (1, ("plain", 2, 512, 1, 8)), (1, ("plain", 2, 512, 1, 4)),
           (2, ("plain", 2, 256, 2, 0)), (2, ("plain", 2, 256, 2, 8)), (2, ("plain", 4, 128, 1, 0)),
           (4, ("plain", 2, 128, 4, 0)), (4, ("plain", 1, 256, 2, 0)),
           (1, ("fp8_group128", 2, 512, 1, 0)), (2, ("fp8_group128", 2, 256, 2, 0))]
v.KERNELS = sorted({k for _, k in SYSTEMS})


def main():
    plan = [("plain", T) for T in (16384, 4096, 1024, 256, 64, 16, 1)] + [("fp8_group128", T) for T in (16384, 1024, 16)]
    v.run_plan(v.rb.start(300), [(prof, T, "cold", [(C, k) for C, k in SYSTEMS if k[0] == prof]) for prof, T in plan],
               "overlap.json")


if __name__ == "__main__":
    main()
