"""Is the Triton kernel's lead at many tokens its compiler's? Triton 3.6 assembles its PTX with the ptxas
it bundles (CUDA 12.8); our programs go through NVRTC 13 (its ptxas). Arms, timed by plain_clone/clone.py's
harness beside the Triton kernel and ours (H 7168, top_k 8 + shared, bf16, plain, cold and warm):
  tri_jit13_128: the Triton kernel's own PTX assembled by the driver (CUDA 13) at 128 registers (its
                 own build's count: two blocks of 8 warps a multiprocessor);
  tri_jit13:     the same without the register bound (the count CUDA 13's ptxas picks);
  tri_reload:    the Triton kernel's own cubin through the same swap (control for tri_jit13*);
  ours_p128:     our programs' PTX (NVRTC 13, the registry's options) assembled by Triton's ptxas 12.8;
and, the other way round, our streaming program's traits put into the Triton kernel one at a time, and
the multiprocessor's split between L1 and shared memory:
  tri_persist:   the Triton kernel on a grid of the resident blocks (two a multiprocessor), each
                 striding over the tokens;
  tri_pairs:     its routes two at a time in a rolled loop (no unrolling, no software pipelining);
  tri_carve100 / ours_carve0: the largest shared-memory carveout for the Triton kernel / the largest
                 L1 for ours (cuFuncSetAttribute PREFERRED_SHARED_MEMORY_CARVEOUT 100 / 0).

    python experiments/world_size_1/ptxas_version/probe.py OUT_JSON
"""
import copy
import hashlib
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "plain_clone"))
import clone  # noqa: E402  (puts the repository on sys.path)
import dispatch  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from dispatch import registry  # noqa: E402
from moe_ar_common import cuda_env  # noqa: E402
from moe_ar_tools.baselines import triton_fused as tf  # noqa: E402
from moe_ar_tools.baselines import triton_kernels  # noqa: E402
from moe_ar_tools.baselines.triton_kernels import _norm_and_quant  # noqa: E402

from ncu_probe import DT, EPS, H, RSF  # noqa: E402

PTXAS_128 = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
use_p128 = [False]
_compile_cubin, _cache_key = registry.compile_cubin, registry._cache_key


def compile_p128(source, name, target):
    """NVRTC to PTX with the registry's options, then Triton's ptxas 12.8 (PTX ISA 8.7 declared)."""
    nvrtc, version = cuda_env.load_nvrtc()
    options = [f"--gpu-architecture={target.replace('sm_', 'compute_')}", *registry.program_set().manifest["compile_options"],
               f"-I{cuda_env.include_dir(version[0])}"]
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx.decode() if isinstance(ptx, bytes) else ptx)
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "p.ptx").write_text(ptx)
        log = subprocess.run([str(PTXAS_128), f"-arch={target}", "-O3", "-v", f"{d}/p.ptx", "-o", f"{d}/p.cubin"],
                             capture_output=True, text=True, check=True).stderr
        used = " ".join(re.findall(r"Used \d+ registers", log))
        print(f"ptxas 12.8: {name}: {used}", flush=True)
        return (pathlib.Path(d) / "p.cubin").read_bytes(), log


registry.compile_cubin = lambda s, n, t: (compile_p128 if use_p128[0] else _compile_cubin)(s, n, t)
# a key of its own, also in the cache file's name (its first 32 characters)
registry._cache_key = lambda s, t: (hashlib.sha256((_cache_key(s, t) + "ptxas 12.8").encode()).hexdigest()
                                    if use_p128[0] else _cache_key(s, t))


@triton.jit
def _row(x_ptr, idx_ptr, w_ptr, shared_ptr, res_in_ptr, gamma_ptr, res_out_ptr, norm_ptr, rows, H, rsf, eps, t,
         K: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    # triton_kernels.fused's plain row (fp32 router weights, shared expert), its routes unrolled or, with
    # PAIRS, two at a time in a rolled loop
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if PAIRS:
        for k0 in tl.range(0, K, 2, loop_unroll_factor=1, num_stages=1):
            ra = tl.load(idx_ptr + t * K + k0)
            rb = tl.load(idx_ptr + t * K + k0 + 1)
            oka = (ra >= 0) & (ra < rows)
            okb = (rb >= 0) & (rb < rows)
            wa = tl.load(w_ptr + t * K + k0)
            wb = tl.load(w_ptr + t * K + k0 + 1)
            xa = tl.load(x_ptr + tl.where(oka, ra, 0).to(tl.int64) * H + offs, mask=mask & oka, other=0.0)
            xb = tl.load(x_ptr + tl.where(okb, rb, 0).to(tl.int64) * H + offs, mask=mask & okb, other=0.0)
            acc += tl.where(oka, wa, 0.0) * xa.to(tl.float32)
            acc += tl.where(okb, wb, 0.0) * xb.to(tl.float32)
    else:
        for k in tl.static_range(K):
            row = tl.load(idx_ptr + t * K + k)
            ok = (row >= 0) & (row < rows)
            w = tl.load(w_ptr + t * K + k)
            xk = tl.load(x_ptr + tl.where(ok, row, 0).to(tl.int64) * H + offs, mask=mask & ok, other=0.0)
            acc += tl.where(ok, w, 0.0) * xk.to(tl.float32)
    s = acc * rsf + tl.load(shared_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    s += tl.load(res_in_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    r = s.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + t * H + offs, r, mask=mask)
    _norm_and_quant(r, t, H, offs, mask, gamma_ptr, norm_ptr, norm_ptr, norm_ptr, norm_ptr, eps, 0.0, 0, BLOCK, 128)


@triton.jit
def fused_variant(x_ptr, idx_ptr, w_ptr, shared_ptr, res_in_ptr, gamma_ptr, res_out_ptr, norm_ptr, T, rows, H, rsf,
                  eps, K: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr, PERSIST: tl.constexpr):
    if PERSIST:
        for t in tl.range(tl.program_id(0), T, tl.num_programs(0), num_stages=1):
            _row(x_ptr, idx_ptr, w_ptr, shared_ptr, res_in_ptr, gamma_ptr, res_out_ptr, norm_ptr, rows, H, rsf, eps,
                 t.to(tl.int64), K, BLOCK, PAIRS)
    else:
        _row(x_ptr, idx_ptr, w_ptr, shared_ptr, res_in_ptr, gamma_ptr, res_out_ptr, norm_ptr, rows, H, rsf, eps,
             tl.program_id(0).to(tl.int64), K, BLOCK, PAIRS)


def variant_call(T, pairs, persist):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(T, 2 * sms),) if persist else (T,)

    def run(s):
        fused_variant[grid](s["allreduce_in"], s["idx"], s["scale"], s["shared"], s["residual"], s["gamma"],
                            s["residual_out"], s["norm_out"], T, s["allreduce_in"].shape[0], H, RSF, EPS, K=s["idx"].shape[1],
                            BLOCK=8192, PAIRS=pairs, PERSIST=persist, num_warps=8)
    return run


def set_carveout(function, percent):
    from cuda.bindings import driver as cu
    err, = cu.cuFuncSetAttribute(cu.CUfunction(function),
                                 cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, percent)
    assert int(err) == 0, err


def triton_entry():
    """(the kernel cache, key, compiled kernel) of the one Triton `fused` build this process has run."""
    found = [(cache, key, k) for cache, *_ in triton_kernels.fused.device_caches.values() for key, k in cache.items()
             if k.name == "fused"]
    assert len(found) == 1, [k.metadata.num_warps for _, _, k in found]
    return found[0]


def swapped(binary):
    """A copy of the Triton build holding `binary` (a cubin, or PTX the driver assembles)."""
    cache, key, kernel = triton_entry()
    other = copy.copy(kernel)
    other.kernel, other.module, other.function, other._run = binary, None, None, None
    other._init_handles()
    print(f"swapped build: {other.n_regs} registers, {other.n_spills} spilled", flush=True)
    return other


def extra(T):
    if not any(c for c, *_ in triton_kernels.fused.device_caches.values()):
        clone.call_triton(clone.inputs(T, 1))  # builds it
    cache, key, kernel = triton_entry()
    ptx = kernel.asm["ptx"]
    bounded = re.sub(r"(\.visible \.entry fused\([^)]*\))", r"\1\n.maxnreg 128", ptx, count=1)
    assert bounded != ptx
    builds = {"tri_jit13_128": swapped(bounded.encode() + b"\0"), "tri_jit13": swapped(ptx.encode() + b"\0"),
              "tri_reload": swapped(kernel.kernel), "tri_carve100": swapped(kernel.kernel)}
    set_carveout(builds["tri_carve100"].function, 100)

    def through(build):
        def run(s):
            cache[key] = build
            try:
                clone.call_triton(s)
            finally:
                cache[key] = kernel
        return run

    arms = {name: through(b) for name, b in builds.items()}
    arms["tri_persist"] = variant_call(T, False, True)
    arms["tri_pairs"] = variant_call(T, True, False)
    arms["ours_p128"] = ours_variant(T, p128=True)
    arms["ours_carve0"] = ours_variant(T, carveout=0)
    return arms


def ours_variant(T, p128=False, carveout=None):
    """Ours with programs loaded apart from the others' (a workspace and loaded programs of its own):
    assembled by ptxas 12.8, or with the carveout set after its first call."""
    ws = dispatch.LocalWorkspace(max_tokens=T, hidden=H, dtype=DT)
    loaded, done = {}, []

    def run(s):
        saved, registry._loaded = registry._loaded, loaded
        use_p128[0] = p128
        try:
            clone.call_ours(ws, s)
            if carveout is not None and not done:  # every program the call loaded (its shape build)
                for prog in loaded.values():
                    set_carveout(prog.function_ptr, carveout)
                done.append(len(loaded))
        finally:
            registry._loaded, use_p128[0] = saved, False
    return run


if __name__ == "__main__":
    torch.cuda.init()
    clone.main(sys.argv[1], arms={}, tokens=(256, 1024, 2048, 8192), extra=extra)
