"""The op's bytes at TOKENS (default 128-8,192), measured the way the bench measures every system: kernels that
read and write exactly what the plain tail must (a token's indices and weights, its 8 routed rows, the
shared and residual rows; residual_out and norm_out) and skip the sum of squares and the norm
(norm_out gets residual_out's bits), beside ours and the Triton kernel, H 7168 top_k 8 + shared, cold
L2. `bytes_triton`: the Triton kernel of moe_ar_tools.baselines with its norm cut out (num_warps 4, 8,
16); `floor` c1_v2_n2: floor.cu's one token a block, every load at once, both stores. No output of
those is checked (they do less than the op). `floor` c1_v2_n1: floor.cu's whole plain tail, one token a
block (checked like ours). PROFILES (default plain) adds the FP8 profiles' ours and Triton kernel to
the same run (the floor kernels run with plain).
    PYTHONPATH=. [PROFILES=plain,fp8_group128_row,fp8_tensor] python experiments/world_size_1/floor/bytes_probe.py OUT [TOKENS]"""
import contextlib, os, sys
import cupy as cp
import torch
import triton
import triton.language as tl
from moe_ar_common import cuda_env
from moe_ar_tools.bench.config import ROUTED_SCALING_FACTOR, EPS
from moe_ar_tools.bench.world_one import summary
from moe_ar_tools.bench.world_one.systems import Setup, System
from moe_ar_tools.bench.cli import main


@triton.jit
def op_bytes(x_ptr, idx_ptr, w_ptr, shared_ptr, res_in_ptr, res_out_ptr, norm_ptr, H, rsf,
             K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(idx_ptr + t * K + k).to(tl.int64)
        w = tl.load(w_ptr + t * K + k)
        acc += w * tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    s = acc * rsf + tl.load(shared_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(res_in_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    r = s.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + t * H + offs, r, mask=mask)
    tl.store(norm_ptr + t * H + offs, r, mask=mask)


out = sys.argv[1]
tokens = sys.argv[2] if len(sys.argv) > 2 else "128,256,512,1024,2048,8192"
source = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor.cu")).read()
module = cp.RawModule(code=source, options=("-std=c++17", "--gpu-architecture=sm_90a",
                                            "-I" + cuda_env.include_dir()))
summary.RECORD_SYSTEMS = summary.RECORD_SYSTEMS + ("floor", "bytes_triton")
committed_build = Setup.build_systems


def floor_system(self, shape, T, data, n=2):
    sets, H = data["sets"], shape.hidden
    f = module.get_function(f"floor_c1_v2_n{n}")
    outs = [self.outputs(T, H, "plain") for _ in sets]

    def call(j):
        x, o = sets[j % len(sets)], outs[j % len(sets)]
        args = tuple(cp.uint64(t.data_ptr()) for t in (x.allreduce_in, x.idx, x.scale, x.shared, x.residual,
                                                         x.norm_weight, o["residual_out"], o["norm_out"]))
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            f((T,), (H // 16,), args + (cp.int32(H), cp.float32(ROUTED_SCALING_FACTOR), cp.float32(EPS)))
    return System("floor", f"c1_v2_n{n}", call, list(enumerate(outs)) if n == 1 else [])


def triton_system(self, nw, shape, T, data):
    sets, H = data["sets"], shape.hidden
    outs = [self.outputs(T, H, "plain") for _ in sets]

    def call(j):
        x, o = sets[j % len(sets)], outs[j % len(sets)]
        op_bytes[(T,)](x.allreduce_in, x.idx, x.scale, x.shared, x.residual, o["residual_out"], o["norm_out"], H,
                       float(ROUTED_SCALING_FACTOR), K=8, BLOCK=triton.next_power_of_2(H), num_warps=nw)
    return System("bytes_triton", f"num_warps={nw}", call, [])


def build_systems(self, shape, T, profile, data):
    systems, nulls = committed_build(self, shape, T, profile, data)
    if profile == "plain" and shape.top_k == 8 and shape.shared:
        systems += [floor_system(self, shape, T, data, n) for n in (2, 1)] + [triton_system(self, nw, shape, T, data) for nw in (4, 8, 16)]
    return systems, nulls


Setup.build_systems = build_systems
with open(f"{out}/bytes.log", "w") as f, contextlib.redirect_stdout(f):
    main(["--world", "1", "--shapes", "7168:8:shared", "--tokens", tokens, "--profiles", os.environ.get("PROFILES", "plain"), "--systems",
          "ours,triton_fused", "--compile-modes", "dynamic", "--no-programs", "--l2", "cold",
          "--budget-s", os.environ.get("FLOOR_BUDGET_S", "150"), "--out", f"{out}/bytes"], standalone_mode=False)
print("bytes: done", flush=True)
