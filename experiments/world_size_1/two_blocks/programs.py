"""The committed world-size-1 programs (lc, lcs) against the Triton baselines at the token counts
where their boundary and the streaming layout's gain are decided. Same harness as probe.py.

    PYTHONPATH=. python experiments/world_size_1/two_blocks/programs.py --out DIR [--budget-s 200]
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import time

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("two_blocks_probe", HERE / "probe.py")
tb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tb)
rb, sp = tb.rb, tb.sp


def main():
    args, out, t_start, l2, mod, state, results = rb.start(200)
    plan = [(prof, T, 7168, 8, True, "cold") for prof in ("plain", "nvfp4", "fp8_tensor", "fp8_group128")
            for T in (32, 64, 96, 128, 192, 256, 1024, 4096, 16384)]
    plan += [("plain", T, H, K, False, "cold") for (H, K) in ((4096, 2), (2048, 8)) for T in (64, 128, 256, 8192)]
    plan += [("plain", T, 7168, 8, True, "warm") for T in (128, 256, 4096)]
    for prof, T, H, K, sh, mode in plan:
        if time.perf_counter() - t_start > args.budget_s:
            sp.log(f"budget: stop before {prof} T {T} H {H} {mode}")
            continue
        r = sp.point(mod, state, prof, T, H, K, sh, mode, l2, [], 15 if T <= 2048 else 9, {})
        results["points"].append(r)
        us = r["us"]
        tr = min((v, k) for k, v in us.items() if k.startswith("triton")) if any(
            k.startswith("triton") for k in us) else (float("nan"), "-")
        sp.log(f"{prof} H{H} K{K} T{T} {mode}: triton {tr[0]:.2f} ({tr[1]}) lc {us.get('old_lc', float('nan')):.2f} "
               f"lcs {us.get('old_lcs', float('nan')):.2f} triton/lcs {tr[0] / us.get('old_lcs', float('nan')):.3f} "
               f"errors {sorted(r['errors'])}")
        (out / "programs.json").write_text(json.dumps(results, indent=1))
    sp.log(f"done in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
