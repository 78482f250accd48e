"""The cluster layout's blocks at H 6144, 7168 and 8192: one vector a thread over C blocks of
threads/C (the committed 8 blocks; 6 or 7 blocks of 4 warps), or the one-block split of two vectors
a thread over 8 blocks (the layout before), arms interleaved A/B/A/B in one process, the bench
checking every output of ours against the float64 reference before it times it.
    PYTHONPATH=. python experiments/world_size_1/cluster_one_vector/blocks.py OUT"""
import contextlib, sys, time
from dispatch import launcher, registry
from dispatch.workspace_sizes import RowSplit
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
arm = {}  # nvec -> (blocks, threads, vectors a thread) of the arm; absent: the committed layout
committed_init = launcher._Launcher.__init__


def init(self, ws, name):
    """The committed launcher, its cluster layout then set to the arm's."""
    committed_init(self, ws, name)
    layout = arm.get(ws.hidden // 8)
    if self.cluster_blocks > 1 and layout:
        blocks, threads, vpt = layout
        self.cluster_blocks, self.cluster_split = blocks, RowSplit(self.cluster_max_tokens, threads, vpt)
        self.cluster_attrs = (launcher._cluster_attributes(blocks, False), launcher._cluster_attributes(blocks, True))
    if self.cluster_blocks > 1:
        print(f"{name} H {ws.hidden}: cluster of {self.cluster_blocks} blocks, {self.cluster_split}", flush=True)


launcher._Launcher.__init__ = init
ARMS = {  # shape: {arm name: {nvec: (blocks, threads, vectors a thread)}}
    "6144:8:shared": {"8x96": {}, "6x128": {768: (6, 768, 1)}, "8x64v2": {768: (8, 512, 2)}},
    "7168:8:shared": {"8x128": {}, "7x128": {896: (7, 896, 1)}},
    "8192:8:shared": {"8x128": {}, "8x64v2": {1024: (8, 512, 2)}},
}
for rep in ("", "b"):
    for shape, arms in ARMS.items():
        for name, layout in arms.items():
            arm.clear()
            arm.update(layout)
            registry._loaded.clear()  # the builds compile the row's threads in
            run = f"{shape.split(':')[0]}-{name}{rep}"
            t0 = time.perf_counter()
            with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
                main(["--world", "1", "--shapes", shape, "--tokens", "1,16,32,48", "--profiles", "plain,nvfp4",
                      "--systems", "ours", "--compile-modes", "dynamic", "--no-programs", "--budget-s", "25",
                      "--out", f"{out}/{run}"], standalone_mode=False)
            print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
