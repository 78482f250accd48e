"""Offline (no GPU): the streaming program's shape builds of one or more trees, their registers and
spills, and per token what the SASS executes: instructions a thread and fixed-latency stall cycles
(the control bits' stall counts beyond one), as the launcher builds them for H 7168 (224 threads x 4
vectors) and H 4096 (128 x 4), top_k 8, fp32 router weights (FP8 group-128, which has no shape
build, as the program).

    python experiments/world_size_1/stream_prefetch/sass_counts.py NAME=TREE [NAME=TREE ...]

A token = the token loop's straight line once (the largest backward branch) with its route loop
(the largest backward branch inside it) top_k / 2 times; both sides of a branch inside are counted.
The counting follows bench_results/world_size_1/stream_indices/README.md (checked there against
Nsight Compute's instruction counts). Each TREE is imported in its own process (its dispatch, its
generated programs); needs cuobjdump (the test extra).
"""
import json
import re
import subprocess
import sys

PROFILES = ("plain", "fp8_tensor", "nvfp4", "fp8_group128")
SHAPES = ((7168, 4, 224), (4096, 4, 128))

BUILD = r'''
import json, sys
sys.path.insert(0, ".")
from dispatch import registry, shape_constants
from moe_ar_tools import sass_diff
tools = sass_diff.find_tools()
ps = registry.program_set()
out = {}
for profile in %r:
    name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
    for H, vpt, threads in %r:
        # a shape build where the launcher makes one (shape_constants.STREAMING_PROFILES), else the program
        built = profile in shape_constants.STREAMING_PROFILES
        prefix = shape_constants.defines(H, 8, 1, vpt, threads) if built else ""
        source = prefix + registry._manifest.source_for(ps.manifest, ps.dir, name)
        cubin, log = registry.compile_cubin(source, name, "sm_90a")
        log = log if isinstance(log, str) else log.decode()
        out[f"{profile} {H}"] = {"sass": sass_diff.disassemble(sass_diff.complete_cubin(cubin), tools), "log": log,
                                 "built": built}
json.dump(out, sys.stdout)
'''

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*")
CONTROL = re.compile(r"/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


def instructions(sass):
    """[(address, text, stall count)] from cuobjdump -sass (the second word's bits 41-44)."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = LINE.search(line)
        if m and i + 1 < len(lines) and (c := CONTROL.search(lines[i + 1])):
            out.append((int(m.group(1), 16), m.group(2).strip(), (int(c.group(1), 16) >> 41) & 0xF))
    return out


def per_token(sass, top_k=8):
    rows = instructions(sass)
    back = [(a, int(m.group(1), 16)) for a, t, _ in rows
            if (m := re.search(r"BRA (0x[0-9a-f]+)", t)) and "DIV" not in t and int(m.group(1), 16) < a]
    loop_end, loop_head = max(back, key=lambda b: b[0] - b[1])
    inner = [b for b in back if loop_head < b[1] and b[0] < loop_end]
    routes_end, routes_head = max(inner, key=lambda b: b[0] - b[1])

    def span(lo, hi):
        part = [s for a, _, s in rows if lo <= a < hi]
        return len(part), sum(max(s - 1, 0) for s in part)

    spans = [span(loop_head, routes_head), span(routes_head, routes_end + 16), span(routes_end + 16, loop_end + 16)]
    times = (1, top_k // 2, 1)
    return tuple(sum(n * s[i] for n, s in zip(times, spans)) for i in range(2))


def main(arms):
    results = {}
    for arm in arms:
        name, tree = arm.split("=", 1)
        done = subprocess.run([sys.executable, "-c", BUILD % (PROFILES, SHAPES)], cwd=tree, capture_output=True,
                              text=True, check=True)
        results[name] = json.loads(done.stdout)
    print("| build | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for key in next(iter(results.values())):
        cells = []
        for name, builds in results.items():
            log = builds[key]["log"]
            regs = re.search(r"Used (\d+) registers", log).group(1)
            spill = max(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
            instr, stall = per_token(builds[key]["sass"])
            program = "" if builds[key]["built"] else " (no shape build)"
            cells.append(f"{regs} regs, {spill} B spill, {instr} instr, {stall} stall{program}")
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
