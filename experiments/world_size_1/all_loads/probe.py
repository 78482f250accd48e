"""The latency program's every-load-at-once path past 16 tokens: its threshold (kAllLoadsMaxTokens) at
16 as committed, at 64 and at 256, A/B/C/A in one process (the source substituted before NVRTC, the loaded
programs dropped between arms; shape builds as by default), at the shapes without the cluster layout
(H 4096, 2048) and at H 7168.
Ran at 05f7a11 (from 437679b a build's MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS decides instead: check that
commit out to rerun it).
    PYTHONPATH=. python experiments/world_size_1/all_loads/probe.py OUT"""
import contextlib, sys, time
from dispatch import registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed = registry._manifest.source_for
LINE = "constexpr int kAllLoadsMaxTokens = 16;"


def with_threshold(n):
    def source_for(manifest, d, name):
        s = committed(manifest, d, name)
        if name.startswith("moe_ar_local_") and "streaming" not in name:
            assert LINE in s
            s = s.replace(LINE, f"constexpr int kAllLoadsMaxTokens = {n};")
        return s
    return source_for


for run, n in (("base0", 16), ("all64", 64), ("all256", 256), ("base1", 16)):
    registry._manifest.source_for = with_threshold(n)
    registry._loaded.clear()  # a loaded program is kept per (name, device, prefix): load the new source
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "4096:8,2048:8,7168:8:shared", "--tokens", "17,32,48,64,96,128", "--profiles",
              "plain,fp8_tensor", "--systems", "ours", "--compile-modes", "dynamic", "--no-programs",
              "--budget-s", "110", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
