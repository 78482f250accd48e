"""Offline (no GPU): the Triton baseline's `fused` kernel compiled for sm_90 as its launcher runs it
(pointers and H divisible by 16), bf16, fp32 router weights, plain: registers, SASS instructions and
128-bit loads, per (H, top_k, num_warps). Needs Triton 3.6 (the GPU machine's) on sys.path, e.g.
`pip install --no-deps --target /tmp/t36 triton==3.6.0`.

    python experiments/world_size_1/small_rows_streaming/triton_registers.py /tmp/t36
"""
import inspect
import pathlib
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/tmp/t36")
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[3]))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moe_ar_tools.baselines import triton_kernels  # noqa: E402

POINTERS = {"x_ptr": "*bf16", "idx_ptr": "*i32", "w_ptr": "*fp32", "shared_ptr": "*bf16", "res_in_ptr": "*bf16",
            "gamma_ptr": "*bf16", "res_out_ptr": "*bf16", "norm_ptr": "*bf16", "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32", "qscale_ptr": "*fp32"}
CASES = [(4096, 2, False, 4), (4096, 8, False, 4), (4096, 8, False, 8), (2048, 8, False, 4), (2048, 8, False, 2),
         (7168, 8, True, 8), (7168, 8, True, 4), (5120, 1, True, 4)]


def compile_fused(hidden, top_k, shared, num_warps):
    names = list(inspect.signature(triton_kernels.fused.fn).parameters)
    sig = {n: POINTERS.get(n, "i32" if n in ("rows", "H") else "fp32" if n in ("rsf", "eps", "weight_bias")
                        else "constexpr") for n in names}
    constexprs = {"K": top_k, "HAS_W": True, "HAS_SHARED": shared, "QUANT": 0,
                  "BLOCK": max(128, 1 << (hidden - 1).bit_length()), "GROUP": 128}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*POINTERS, "H"]}
    src = ASTSource(fn=triton_kernels.fused, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["cubin"]


def main():
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    print("| H | top_k | shared | num_warps | registers | blocks a multiprocessor (registers) | SASS | LDG |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for hidden, top_k, shared, nw in CASES:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compile_fused(hidden, top_k, shared, nw))
            f.flush()
            res = subprocess.check_output([str(cuobjdump), "-res-usage", f.name], text=True)
            sass = subprocess.check_output([str(cuobjdump), "-sass", f.name], text=True)
        regs = int(re.search(r"REG:(\d+)", res).group(1))
        blocks = 65536 // (32 * nw * -(-regs // 8) * 8)
        instructions = len(re.findall(r"^\s+/[*][0-9a-f]{4}[*]/", sass, re.M))
        print(f"| {hidden} | {top_k} | {shared} | {nw} | {regs} | {blocks} | {instructions} | {sass.count('LDG')} |")


if __name__ == "__main__":
    main()
