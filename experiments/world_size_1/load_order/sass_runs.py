"""Offline (no GPU): the order of a row's loads in world size 1's latency program as the launcher builds
it (shape builds, top_k 8, fp32 router weights, 2 vectors a thread), under the committed kernel bound
and under `__launch_bounds__(512, 1)`, sm_90a. For the one-block kernel's every-load-at-once path
(the calls of up to 256 tokens: the branch on tokens > 256 skips the four-routes path), the runs of
16-byte loads between additions: "20" is every load of the row (16 routes' vectors, the residual
and the shared row, 2 each) issued before the first addition; "8, 1, 1, ..." is 8 loads, then one
load between additions, one memory latency more. Also the registers ptxas gave the kernel.

    python experiments/world_size_1/load_order/sass_runs.py > bench_results/world_size_1/load_order/sass_runs.md
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from dispatch import registry, shape_constants  # noqa: E402
from moe_ar_tools import sass_diff  # noqa: E402

COMMITTED = "__launch_bounds__(512) moe_ar_local_"
ONE_BLOCK = "__launch_bounds__(512, 1) moe_ar_local_"
# the every-load-at-once path starts where the branch on tokens > 256 (0x101 and up) jumps
BRANCH = re.compile(r"ISETP\.GE\.AND P(\d), PT, R\d+, 0x101, PT[^@]{0,800}@!P\1 BRA 0x([0-9a-f]+)")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][^;]*);")


def load_runs(function: str) -> list:
    """The 16-byte loads between additions (FFMA) from the every-load-at-once path's first instruction."""
    branch = BRANCH.search(function)
    start = int(branch.group(2), 16) if branch else 0
    runs, n = [], 0
    for address, text in INSTRUCTION.findall(function):
        if int(address, 16) < start:
            continue
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
        if op.startswith("LDG.E.128"):
            n += 1
        elif op.startswith("FFMA") and n:
            runs.append(n)
            n = 0
    return runs + ([n] if n else [])


def main():
    tools = sass_diff.find_tools()
    ps = registry.program_set()
    print("| profile | H | bound | registers | 16-byte loads between additions (first 8 runs) |")
    print("|---|---:|---|---:|---|")
    for profile in ("plain", "fp8_group128", "fp8_tensor", "nvfp4"):
        name = f"moe_ar_local_bf16_ws1_{profile}"
        committed = registry._manifest.source_for(ps.manifest, ps.dir, name)
        for H in (2048, 4096, 7168):
            for bound, text in (("512", committed), ("512, 1", committed.replace(COMMITTED, ONE_BLOCK))):
                source = shape_constants.defines(H, 8, 1, 2, H // 16) + text
                cubin, log = registry.compile_cubin(source, name, "sm_90a")
                log = log if isinstance(log, str) else log.decode()
                sass = sass_diff.disassemble(sass_diff.complete_cubin(cubin), tools)
                body = next(f for f in re.split(r"\n\s*Function : ", sass)[1:] if f.split("\n", 1)[0].strip() == name)
                regs = re.search(r"Compiling entry function '" + name + r"'.*?Used (\d+) registers", log, re.S)
                runs = load_runs(body)
                print(f"| {profile} | {H} | `({bound})` | {regs.group(1) if regs else '?'} | "
                      f"{', '.join(map(str, runs[:8]))}{', ...' if len(runs) > 8 else ''} |", flush=True)


if __name__ == "__main__":
    main()
