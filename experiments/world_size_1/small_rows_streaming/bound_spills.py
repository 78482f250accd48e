"""Offline (no GPU): world size 1's streaming program built for (H, top_k) at 4 and 2 vectors a
thread under register bounds 128 (committed), 96, 80 and 64: registers and spill bytes from ptxas,
sm_90a, fp32 router weights.

    python experiments/world_size_1/small_rows_streaming/bound_spills.py
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from dispatch import registry, shape_constants  # noqa: E402


def main():
    ps = registry.program_set()
    print("| profile | H | top_k | vectors a thread | threads | bound | registers | spill stores (B) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for profile in ("plain", "fp8_tensor", "fp8_group128", "nvfp4"):
        name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
        source = registry._manifest.source_for(ps.manifest, ps.dir, name)
        for hidden, top_k in ((4096, 2), (4096, 8), (2048, 8)):
            for vec in (4, 2):
                threads = hidden // 8 // vec
                for bound in (128, 96, 80, 64):
                    text = shape_constants.defines(hidden, top_k, 1, vec, threads) + \
                        source.replace("__maxnreg__(128)", f"__maxnreg__({bound})")
                    _, log = registry.compile_cubin(text, name, "sm_90a")
                    log = log if isinstance(log, str) else log.decode()
                    entry = log.split(f"Compiling entry function '{name}'", 1)[1]
                    regs = re.search(r"Used (\d+) registers", entry).group(1)
                    spill = re.search(r"(\d+) bytes spill stores", entry).group(1)
                    print(f"| {profile} | {hidden} | {top_k} | {vec} | {threads} | {bound} | {regs} | {spill} |",
                          flush=True)


if __name__ == "__main__":
    main()
