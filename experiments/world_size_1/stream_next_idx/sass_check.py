"""Offline (no GPU): registers, spills and SASS size of world size 1's streaming program in one or
more trees, as the launcher runs it for top_k 2 (the program for every shape) and builds it for
top_k 8 (H 7168: 224 threads x 4 vectors, H 4096: 128 x 4), fp32 router weights; sm_90a.

    python experiments/world_size_1/stream_next_idx/sass_check.py NAME=TREE [NAME=TREE ...]
"""
import json
import re
import subprocess
import sys

BUILD = r'''
import json, re, sys
sys.path.insert(0, ".")
from dispatch import registry, shape_constants
from moe_ar_tools import sass_diff
tools = sass_diff.find_tools()
ps = registry.program_set()
out = {}
for profile in ("plain", "fp8_tensor", "nvfp4", "fp8_group128"):
    name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
    builds = [("program", "")]
    if profile in shape_constants.STREAMING_PROFILES:
        builds += [(f"build {H} top_k 8", shape_constants.defines(H, 8, 1, 4, threads)) for H, threads in ((7168, 224), (4096, 128))
                   if H <= shape_constants.STREAMING_MAX_HIDDEN[profile]]
    for label, prefix in builds:
        source = prefix + registry._manifest.source_for(ps.manifest, ps.dir, name)
        cubin, log = registry.compile_cubin(source, name, "sm_90a")
        log = log if isinstance(log, str) else log.decode()
        sass = sass_diff.disassemble(sass_diff.complete_cubin(cubin), tools)
        out[f"{profile} {label}"] = {"log": log, "instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))}
json.dump(out, sys.stdout)
'''


def main(arms):
    results = {}
    for arm in arms:
        name, tree = arm.split("=", 1)
        done = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout)
    print("| streaming program | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for key in next(iter(results.values())):
        cells = []
        for builds in results.values():
            log = builds[key]["log"]
            regs = re.search(r"Used (\d+) registers", log).group(1)
            spill = max(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
            cells.append(f"{regs} regs, {spill} B spill, {builds[key]['instructions']} SASS")
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
