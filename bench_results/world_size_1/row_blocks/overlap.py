"""The third row_blocks run: does a second resident block (the loads of one token under the
epilogue of another) close the gap, and what does the sum of squares itself cost? Kernels of
variants.patch: a token over a cluster of C = 2 or 4 blocks, so that a block is small enough for
2-4 to be resident at 128-235 registers; variant bit 8: the epilogue without the sum of squares
(timing only, norm_out's scale is eps). Same command as variants.py, with overlap.py."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import time

import torch

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
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=300)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 60 << 20))
    sp.warm_clocks()
    fl = sp.floors()
    sp.log(f"floors: {fl}")
    mod = sp.SplitModule()
    state = torch.zeros(8, dtype=torch.int32, device="cuda")
    results = {"gpu": props.name, "l2_bytes": l2, "floors": fl, "points": [], "commit": os.environ.get("MOE_AR_COMMIT")}
    plan = [("plain", T) for T in (16384, 4096, 1024, 256, 64, 16, 1)] + [("fp8_group128", T) for T in (16384, 1024, 16)]
    orig = sp.SplitLauncher
    for prof, T in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T}")
            continue
        shaped = [(C, k[1], v.kname(*k), False) for C, k in SYSTEMS if k[0] == prof]

        def make(mod_, profile, C, vec, name, H_, state_ptr, pdl=False):
            return rb.Launcher(mod_, "plain", C, vec, 0, H_, state_ptr, pdl, 512, 1, C > 1, name=name)
        sp.SplitLauncher = make
        try:
            r = sp.point(mod, state, prof, T, 7168, 8, True, "cold", l2, shaped, 15 if T <= 2048 else 9, {})
        except Exception as e:  # noqa: BLE001
            sp.log(f"point failed {prof} {T}: {e}")
            torch.cuda.synchronize()
            continue
        finally:
            sp.SplitLauncher = orig
        results["points"].append(r)
        us = r["us"]
        tr = min((x, k) for k, x in us.items() if k.startswith("triton"))
        old = min(x for k, x in us.items() if k.startswith("old"))
        sp.log(f"{prof} T{T}: triton {tr[0]:.2f} ({tr[1]}) old {old:.2f} | " + " ".join(
            f"{k.replace('split_', '').replace('exp_var_', '').replace(prof + '_', '')}={x:.2f}"
            for k, x in sorted(us.items()) if k.startswith("split")) + f" errors {sorted(r['errors'])}")
        (out / "overlap.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
