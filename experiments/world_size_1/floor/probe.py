"""The floor of the plain tail at few tokens, measured the way the bench measures every system: the
chain of floor.cu (a token's indices, its rows, residual_out, the sum of squares, norm_out; no checks,
no state words; one block a token or a cluster of 4 or 8 blocks; `_n0`: no norm) added to the world-size-1
bench as system "floor" next to ours and the Triton kernel, H 7168 top_k 8 + shared, cold and warm L2;
`_n2`: both outputs stored, no sum of squares (the op's bytes moved). The variants with the norm (`_n1`) are
checked against the float64 reference like ours; the others are not.
    PYTHONPATH=. python experiments/world_size_1/floor/probe.py OUT [TOKENS]"""
import contextlib, os, sys
import cupy as cp
import torch
from moe_ar_common import cuda_env
from moe_ar_tools.bench.config import EPS, ROUTED_SCALING_FACTOR
from moe_ar_tools.bench.world_one import summary
from moe_ar_tools.bench.world_one.systems import Setup, System
from moe_ar_tools.bench.cli import main

out = sys.argv[1]
tokens = sys.argv[2] if len(sys.argv) > 2 else "1,16,32,48,64,128,2048,8192"
source = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor.cu")).read()
module = cp.RawModule(code=source, options=("-std=c++17", "--gpu-architecture=sm_90a",
                                            "-I" + cuda_env.include_dir()))
VARIANTS = [(1, 2, 1), (1, 2, 0), (1, 2, 2), (4, 1, 1), (8, 1, 1), (8, 1, 0)]  # (cluster blocks, vectors a thread, N)
if os.environ.get("FLOOR_VARIANTS"):  # e.g. "7,2,1;7,1,1;8,1,1": run 3 (a cluster of 7, as ours was, by vectors a thread)
    VARIANTS = [tuple(int(x) for x in v.split(",")) for v in os.environ["FLOOR_VARIANTS"].split(";")]
summary.RECORD_SYSTEMS = summary.RECORD_SYSTEMS + ("floor",)
committed_build = Setup.build_systems


def floor_system(self, C, V, N, shape, T, data):
    sets, H = data["sets"], shape.hidden
    f = module.get_function(f"floor_c{C}_v{V}_n{N}")
    outs = [self.outputs(T, H, "plain") for _ in sets]
    threads = H // 8 // C // V

    def call(j):
        i = j % len(sets)
        x, o = sets[i], outs[i]
        args = tuple(cp.uint64(t.data_ptr()) for t in (x.allreduce_in, x.idx, x.scale, x.shared, x.residual,
                                                         x.norm_weight, o["residual_out"], o["norm_out"]))
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            f((T * C,), (threads,), args + (cp.int32(H), cp.float32(ROUTED_SCALING_FACTOR), cp.float32(EPS)))
    return System("floor", f"c{C}_v{V}_n{N}", call, list(enumerate(outs)) if N == 1 else [])


def build_systems(self, shape, T, profile, data):
    systems, nulls = committed_build(self, shape, T, profile, data)
    if profile == "plain" and shape.hidden % (8 * 8) == 0 and shape.top_k == 8 and shape.shared:
        systems += [floor_system(self, C, V, N, shape, T, data) for C, V, N in VARIANTS]
    return systems, nulls


Setup.build_systems = build_systems
with open(f"{out}/floor.log", "w") as f, contextlib.redirect_stdout(f):
    main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", tokens, "--profiles", "plain", "--systems",
          "ours,ours_pdl,triton_fused", "--compile-modes", "dynamic", "--no-programs", "--budget-s", os.environ.get("FLOOR_BUDGET_S", "150"),
          "--out", f"{out}/floor"], standalone_mode=False)
print("floor: done", flush=True)
