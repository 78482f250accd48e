"""Offline (no GPU): the landed bound against the A/B's arms, kernel by kernel (sm_90a, normalized SASS).
For each profile and H 2048 / 4096 / 7168 (top_k 8, fp32 router weights), the builds the launcher makes
now (the one-block build of 2 vectors a thread, H/16 threads rounded up to 16 warps at H 7168, and the cluster build, one vector a thread
over 8 blocks) against the same builds of the A/B's source (commit 2548128's programs): "tree" (every
kernel `__launch_bounds__(512)`) and "bound" (every kernel `__launch_bounds__(512, 1)`). Prints which
arm each kernel's SASS equals, so the A/B's figures are the landed code's.

    python experiments/world_size_1/load_order/restricted_sass.py > bench_results/world_size_1/load_order/restricted_sass.md
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from dispatch import registry, shape_constants, workspace_sizes  # noqa: E402
from moe_ar_common import manifest_reader  # noqa: E402
from moe_ar_tools import sass_diff  # noqa: E402

AB_COMMIT = "2548128"
COMMITTED = "__launch_bounds__(512) moe_ar_local_"
ONE_BLOCK = "__launch_bounds__(512, 1) moe_ar_local_"


def functions(source: str, name: str, tools) -> dict:
    """{kernel symbol: normalized SASS} of one build."""
    cubin, log = registry.compile_cubin(source, name, "sm_90a")
    sass = sass_diff.disassemble(sass_diff.complete_cubin(cubin), tools)
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        symbol = part.split("\n", 1)[0].strip()
        out[symbol] = sass_diff.normalize("Function : " + part, symbol)
    return out


def main():
    tools = sass_diff.find_tools()
    ps = registry.program_set()
    print(f"| profile | H | build | kernel | now equals |")
    print("|---|---:|---|---|---|")
    for profile in ("plain", "fp8_group128", "fp8_tensor", "nvfp4"):
        name = f"moe_ar_local_bf16_ws1_{profile}"
        now = registry._manifest.source_for(ps.manifest, ps.dir, name)
        program_ab = subprocess.run(["git", "show", f"{AB_COMMIT}:generated/programs/{name}.cu"], cwd=ROOT,
                                    check=True, capture_output=True, text=True).stdout
        entry = manifest_reader.program_entry(ps.manifest, name)
        tree, _ = manifest_reader.inline_includes(program_ab, entry["file"], ps.manifest["body"]["include_dir"],
                                                  manifest_reader._checked_header_reader(ps.manifest, ps.dir))
        assert tree != now and COMMITTED in tree, name
        arms = {"tree": tree, "bound": tree.replace(COMMITTED, ONE_BLOCK)}
        for H in (2048, 4096, 7168):
            split = workspace_sizes.cluster_row_split(workspace_sizes.row_split(H // 8, 2, 256), H // 8, 12, 8, 512)
            one_block = (split.vec_per_thread, split.threads)  # the launcher's: 512 threads at H 7168
            cluster = workspace_sizes.cluster_layout_split(H // 8, 8, 48)
            for build, (vec, threads) in (("one-block", one_block), ("cluster", (cluster.vec_per_thread, cluster.threads))):
                blocks = shape_constants.one_block_min_blocks(vec, threads, 64) if build == "one-block" else None
                sass_now = functions(shape_constants.defines(H, 8, 1, vec, threads, blocks) + now, name, tools)
                sass_arms = {arm: functions(shape_constants.defines(H, 8, 1, vec, threads) + text, name, tools)
                             for arm, text in arms.items()}
                symbol = name if build == "one-block" else name + "_cluster"
                same = [arm for arm, s in sass_arms.items() if s[symbol] == sass_now[symbol]]
                print(f"| {profile} | {H} | {build} ({threads} threads, {vec} a thread) | {symbol} | "
                      f"{', '.join(same) or 'neither'} |", flush=True)


if __name__ == "__main__":
    main()
