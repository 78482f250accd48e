"""Offline (no GPU): world size 1's latency program as the launcher builds it for H 2048 and 4096,
top_k 8, fp32 router weights, at the committed split (2 vectors a thread) and at one vector a
thread: registers and SASS instructions of its one-block kernel (the all-loads row is straight-line
code, so the count is close to a thread's path for a token); sm_90a.

    python experiments/world_size_1/small_rows_one_vector/sass_sizes.py
"""
import re
import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from dispatch import registry, shape_constants  # noqa: E402
from moe_ar_tools import sass_diff  # noqa: E402

tools = sass_diff.find_tools()
ps = registry.program_set()
print("| profile | H | split | registers | SASS instructions |")
print("|---|---:|---|---:|---:|")
for profile in ("plain", "fp8_group128", "fp8_tensor", "nvfp4"):
    name = f"moe_ar_local_bf16_ws1_{profile}"
    for H in (2048, 4096):
        for vpt in (2, 1):
            threads = H // 8 // vpt
            source = shape_constants.defines(H, 8, 1, vpt, threads) + registry._manifest.source_for(ps.manifest, ps.dir, name)
            cubin, log = registry.compile_cubin(source, name, "sm_90a")
            log = log if isinstance(log, str) else log.decode()
            sass = sass_diff.disassemble(sass_diff.complete_cubin(cubin), tools)
            # the one-block kernel's function in cuobjdump's listing and its line in ptxas' log
            body = next(f for f in re.split(r"\n\s*Function : ", sass)[1:] if f.split("\n", 1)[0].strip() == name)
            regs = re.search(r"Compiling entry function '" + name + r"'.*?Used (\d+) registers", log, re.S)
            print(f"| {profile} | {H} | {vpt} vectors x {threads} threads | {regs.group(1) if regs else '?'} | "
                  f"{len(re.findall(r'/[*][0-9a-f]{4,}[*]/', body))} |")
