"""Run with late_store.patch applied (results: bench_results/world_size_1/late_store/). The latency
program's residual_out stores moved after the row's sum of squares (MOE_AR_PROBE_DEFER: 1 the
cluster layout, 2 the one-block paths, 3 both), or the cluster layout's sum of squares exchanged
with st.async on mbarriers, no cluster-wide release barrier (MOE_AR_PROBE_TXSUM), interleaved arms in one process, the bench checking
every output of ours against the float64 reference before it times it; then the Triton kernel.
    PYTHONPATH=. python experiments/world_size_1/late_store/ab.py OUT"""
import contextlib, sys, time
from dispatch import launcher, registry
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
committed_cubin = registry.cached_cubin
extra = [""]


def cubin_with_extra(name, target, prefix=""):
    return committed_cubin(name, target, extra[0] + prefix)


registry.cached_cubin = cubin_with_extra
committed_cluster_blocks = launcher.cluster_blocks_for
cluster = [0]  # 0: the committed cluster size, else this many blocks where there is a cluster layout


def cluster_blocks(regime, row_splits):
    c = committed_cluster_blocks(regime, row_splits)
    return cluster[0] if cluster[0] and c > 1 else c


launcher.cluster_blocks_for = cluster_blocks
TOKENS = "1,16,32,48,64"
TX = "#define MOE_AR_PROBE_TXSUM 1\n"
D1 = "#define MOE_AR_PROBE_DEFER 1\n"
ARMS = [("d0", "", 0), ("tx", TX, 0), ("txd1", TX + D1, 0), ("c2", "", 2), ("c2tx", TX, 2), ("d0b", "", 0),
        ("txb", TX, 0), ("txd1b", TX + D1, 0)]
for run, define, blocks in ARMS:
    extra[0], cluster[0] = define, blocks
    registry._loaded.clear()
    t0 = time.perf_counter()
    with open(f"{out}/{run}.log", "w") as f, contextlib.redirect_stdout(f):
        main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", TOKENS,
              "--profiles", "plain,fp8_group128_row,nvfp4,fp8_tensor", "--systems", "ours", "--compile-modes",
              "dynamic", "--no-programs", "--budget-s", "50", "--out", f"{out}/{run}"], standalone_mode=False)
    print(f"{run}: {time.perf_counter() - t0:.0f} s", flush=True)
extra[0], cluster[0] = "", 0
registry._loaded.clear()
t0 = time.perf_counter()
with open(f"{out}/triton.log", "w") as f, contextlib.redirect_stdout(f):
    main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", TOKENS,
          "--profiles", "plain,fp8_tensor", "--systems", "ours,triton_fused", "--compile-modes",
          "dynamic", "--no-programs", "--budget-s", "60", "--out", f"{out}/triton"], standalone_mode=False)
print(f"triton: {time.perf_counter() - t0:.0f} s", flush=True)
