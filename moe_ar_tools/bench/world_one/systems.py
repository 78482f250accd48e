"""World size 1's competitors at one point: what a system is (System), the empty kernel of the floor,
the dequantization of a quantized output, and Setup, the run's state on its GPU with what it builds:
its inputs and their float64 check values (inputs.contract_outputs without a process group), ours
(automatic or a forced program), the Triton kernels, the eager and compiled torch chains, the
compiled finalize + FlashInfer's norm kernel."""
from __future__ import annotations

import datetime
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from moe_ar_tools.bench.config import DTYPE_BYTES, EPS, FALLBACK_L2_BYTES, ROUTED_SCALING_FACTOR, Shape
from moe_ar_tools.bench.inputs import contract_outputs, make_input_sets
from moe_ar_tools.bench.outputs import alloc_outputs
from moe_ar_tools.bench.timing import cold_input_sets
from moe_ar_tools.bench.world_one.config import PROFILES, Config
from moe_ar_tools.bench.world_one.summary import make_record


def dequantize(outs: dict, profile: str, fp8_scale_value: float, gs_value: float):
    """float32 [T, H] of a system's quantized output (its scales as laid out)."""
    from moe_ar_tools import reference as ref
    p = PROFILES[profile]
    q = outs["quant_out"]
    if p.quant == "nvfp4":
        T, H = q.shape[0], q.shape[1] * 2
        return ref.nvfp4_dequant(q, outs["scale_out"], gs_value, T, H)
    if p.quant == "fp8_tensor":
        return q.float() * fp8_scale_value
    T = q.shape[0]
    scales = outs["scale_out"] if p.scale_layout == "row" else outs["scale_out"][:, :T].t()
    return q.float() * scales.repeat_interleave(128, dim=1)


_EMPTY_SOURCE = 'extern "C" __global__ void moe_ar_empty() {}\n'


class EmptyKernel:
    """An empty kernel (one block of 32 threads) compiled with the programs' NVRTC, launched on
    torch's current stream: the floor any launch pays."""

    def __init__(self, device_index: int):
        import cupy
        from cupy.cuda import function
        from dispatch import registry
        capability = cupy.cuda.Device(device_index).compute_capability
        target = registry.TARGET_FOR_CAPABILITY[(int(capability[:-1]), int(capability[-1]))]
        cubin, _ = registry.compile_cubin(_EMPTY_SOURCE, "bench_empty_kernel", target)
        with cupy.cuda.Device(device_index):
            self.module = function.Module()
            self.module.load(cubin)
            self.function = self.module.get_function("moe_ar_empty")

    def __call__(self) -> None:
        import torch
        from cuda.bindings import driver as cu
        err, = cu.cuLaunchKernel(cu.CUfunction(int(self.function.ptr)), 1, 1, 1, 32, 1, 1, 0,
                                 cu.CUstream(torch.cuda.current_stream().cuda_stream), None, 0)
        if int(err) != 0:
            raise RuntimeError(f"empty kernel launch failed: {err}")


@dataclass
class System:
    """One competitor at one point. call(j) makes captured call j (input set j % sets) and returns its
    outputs when it allocates them (the chains), None when it writes preallocated ones (ours);
    `outputs` lists (index, outputs) to check, the index a call's or an input set's (the check
    takes it modulo the sets); prepare() poisons them, and restores what a system updates in place,
    before a checked replay."""
    system: str
    variant: Optional[str]
    call: Callable[[int], Optional[dict]]
    outputs: list = field(default_factory=list)
    restore: Optional[Callable[[], None]] = None
    program: Optional[str] = None
    detail: dict = field(default_factory=dict)
    graph: object = None
    compile_s: Optional[float] = None

    @property
    def label(self) -> str:
        return self.system + (f"/{self.variant}" if self.variant else "")

    def prepare(self) -> None:
        from moe_ar_tools import reference as ref
        if self.restore is not None:
            self.restore()
        for _, outs in self.outputs:
            ref.repoison({k: v for k, v in outs.items() if not (self.restore and k == "residual_out")})


CHAIN_NUM_WARPS = (4, 8, 16)  # the chain's kernels' launch parameter, swept like triton_fused's


def _error(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


class Setup:
    """The run's state on this process's current GPU (another `device`, with a `capability` to assume,
    only for the CPU test that stubs CUDA graphs, events and the op), its inputs and the systems it
    builds at a point; Runner (moe_ar_tools/bench/world_one/runner.py) captures, checks and times them."""

    def __init__(self, cfg: Config, device=None, capability: tuple = (9, 0)):
        import torch
        self.cfg = cfg
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        self.capability, self.l2_bytes = capability, FALLBACK_L2_BYTES
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.capability = (props.major, props.minor)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)
        self.records, self.skipped = [], []
        self.workspaces, self.compiled = {}, {}
        self.failed = {}  # (system, compile mode, profile) -> why it could not run: not compiled again
        self.flashinfer, self.flashinfer_info = None, {}
        self.longest_point_s = 0.0
        self.out = pathlib.Path(cfg.out) if cfg.out else pathlib.Path("bench_results") / "world_size_1" / \
            f"run-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def record(self, **fields) -> dict:
        """summary.make_record of this run's dtype."""
        return make_record(dtype=self.cfg.dtype, **fields)

    def outputs(self, tokens: int, hidden: int, profile: str) -> dict:
        """The outputs ours writes (dispatch's out arguments) for one input set."""
        p = PROFILES[profile]
        return alloc_outputs(tokens, hidden, self.dtype, p.quant, self.device, p.scale_layout or "row")

    # -- setup --
    def workspace(self, hidden: int):
        import dispatch
        if hidden not in self.workspaces:
            self.workspaces[hidden] = dispatch.LocalWorkspace(max_tokens=max(self.cfg.tokens), hidden=hidden,
                                                              dtype=self.dtype)
        return self.workspaces[hidden]

    def programs_for(self, profile: str) -> list:
        """Every world-size-1 program of this dtype for the profile."""
        import dispatch
        from dispatch.op import profile_for_quant
        want = (1, self.cfg.dtype, profile_for_quant(PROFILES[profile].quant))
        infos = {n: dispatch.program_info(n) for n in dispatch.programs()}
        return [n for n, i in infos.items() if (i["world_size"], i["dtype"], i["profile"]) == want]

    def compiled_fns(self, mode: str):
        """torch_chain.compiled(mode), made once; a failure to set it up is kept as its reason."""
        from moe_ar_tools.baselines import torch_chain
        if mode not in self.compiled:
            try:
                self.compiled[mode] = torch_chain.compiled(mode)
            except Exception as e:  # noqa: BLE001 - recorded, the compiled systems null
                self.compiled[mode] = _error(e)
        return self.compiled[mode]

    def load_flashinfer(self) -> None:
        from moe_ar_tools.baselines import flashinfer_norm
        where = pathlib.Path(self.cfg.flashinfer_dir) if self.cfg.flashinfer_dir else flashinfer_norm.DEFAULT_DIR
        t0 = time.perf_counter()
        try:
            info = flashinfer_norm.read_info(where)
            self.flashinfer = flashinfer_norm.load(where, self.capability)
            self.flashinfer_info = {"available": True, "version": info.get("version"), "library": str(self.flashinfer.path),
                                    "kernels": "CUDA (include/flashinfer/norm.cuh)", "pdl": self.capability >= (9, 0),
                                    "load_s": time.perf_counter() - t0}
            self.log(f"FlashInfer {info.get('version')} norm kernels: {self.flashinfer.path} "
                     f"({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 - the flashinfer system is then null with this reason
            self.flashinfer_info = {"available": False, "reason": _error(e)}
            self.log(f"FlashInfer unavailable: {self.flashinfer_info['reason']}")

    # -- inputs --
    def inputs(self, shape: Shape, T: int, mode: str = "cold") -> dict:
        """The input sets of a point and their float64 check values. cold: enough sets to fill
        3x the L2 (inputs and outputs; bench.timing.cold_input_sets), one captured call each at least;
        warm: one set."""
        import torch
        from moe_ar_tools import reference as ref
        read = (T * shape.top_k + T * (2 if shape.shared else 1)) * shape.hidden * DTYPE_BYTES[self.cfg.dtype]
        bytes_per_set = read + 2 * T * shape.hidden * DTYPE_BYTES[self.cfg.dtype]
        n = 1 if mode == "warm" else cold_input_sets(bytes_per_set, self.l2_bytes)
        sets = make_input_sets(shape, T, n, self.dtype, 0, self.cfg.seed, self.device)
        refs = [contract_outputs(x, self.dtype) for x in sets]
        amax = max(float(norm.abs().max()) for _, norm in refs)
        gs_value, fp8_value = ref.f32(ref.E4M3_MAX * 6.0 / amax), ref.f32(amax / ref.E4M3_MAX)
        return {"sets": sets, "refs": refs, "gs_value": gs_value, "fp8_value": fp8_value, "mode": mode,
                "calls": max(self.cfg.calls, n),
                "gs": torch.tensor([gs_value], dtype=torch.float32, device=self.device),
                "fp8": torch.tensor([fp8_value], dtype=torch.float32, device=self.device)}

    # -- systems --
    def ours(self, shape: Shape, T: int, profile: str, data: dict, program=None, pdl=False, variant=None) -> System:
        import dispatch
        p, sets = PROFILES[profile], data["sets"]
        ws = self.workspace(shape.hidden)
        outs = [self.outputs(T, shape.hidden, profile) for _ in sets]
        extra = {}
        if p.quant == "nvfp4":
            extra["global_scale"] = data["gs"]
        if p.quant == "fp8_tensor":
            extra["fp8_scale"] = data["fp8"]
        if p.quant == "fp8_group128":
            extra["fp8_scale_layout"] = p.scale_layout

        def call(j):
            i = j % len(sets)
            x = sets[i]
            dispatch.moe_finalize_allreduce(
                ws, allreduce_in=x.allreduce_in, expanded_idx_to_permuted_idx=x.idx, residual_in=x.residual,
                norm_weight=x.norm_weight, expert_scale_factor=x.scale, routed_scaling_factor=ROUTED_SCALING_FACTOR,
                shared_expert_output=x.shared, eps=EPS, quant=p.quant, launch_with_pdl=pdl, program=program,
                **extra, **outs[i])
        if program is None:
            try:
                chosen = dispatch.select_program(ws, T, p.quant, shape.shared, top_k=shape.top_k)
            except Exception as e:  # noqa: BLE001 - metadata: the run goes on without the name
                chosen = f"unknown ({_error(e)})"
        else:
            chosen = program
        system = "program" if program is not None else "ours_pdl" if pdl else "ours"
        return System(system, variant, call, list(enumerate(outs)), program=chosen, detail={"pdl": pdl})

    def chain_system(self, system: str, fn, variant, T: int, profile: str, data: dict) -> System:
        p, sets = PROFILES[profile], data["sets"]

        def call(j):
            x = sets[j % len(sets)]
            return fn(x.allreduce_in, x.idx, x.scale, x.shared, x.residual, x.norm_weight, EPS, p.quant,
                      p.scale_layout == "column", data["gs"], data["fp8"])
        return System(system, variant, call)

    def triton_fused_system(self, num_warps: int, shape: Shape, T: int, profile: str, data: dict) -> System:
        """The one-launch Triton kernel into preallocated outputs, one set per input set."""
        from moe_ar_tools.baselines import triton_fused as tf
        p, sets = PROFILES[profile], data["sets"]
        outs = [self.outputs(T, shape.hidden, profile) for _ in sets]

        def call(j):
            i = j % len(sets)
            x = sets[i]
            tf.fused(outs[i], x.allreduce_in, x.idx, x.scale, x.shared, x.residual, x.norm_weight, eps=EPS,
                     routed_scaling_factor=ROUTED_SCALING_FACTOR, quant=p.quant, fp8_scale=data["fp8"],
                     num_warps=num_warps)
        return System("triton_fused", f"num_warps={num_warps}", call, list(enumerate(outs)))

    def triton_chain_system(self, num_warps: int, shape: Shape, T: int, profile: str, data: dict) -> System:
        """The Triton gather-sum to a [T, H] partial, then the Triton add + RMSNorm (+ FP8)."""
        import torch
        from moe_ar_tools.baselines import triton_fused as tf
        p, sets = PROFILES[profile], data["sets"]
        outs = [self.outputs(T, shape.hidden, profile) for _ in sets]
        partials = [torch.empty(T, shape.hidden, dtype=self.dtype, device=self.device) for _ in sets]

        def call(j):
            i = j % len(sets)
            x = sets[i]
            tf.gather_sum(partials[i], x.allreduce_in, x.idx, x.scale, x.shared,
                          routed_scaling_factor=ROUTED_SCALING_FACTOR, num_warps=num_warps)
            tf.add_rmsnorm(outs[i], partials[i], x.residual, x.norm_weight, eps=EPS, quant=p.quant,
                           fp8_scale=data["fp8"], num_warps=num_warps)
        return System("chain", f"triton num_warps={num_warps}", call, list(enumerate(outs)))

    def triton_finalize(self, num_warps: int):
        """finalize(allreduce_in, idx, scale, shared) -> partial by the Triton gather-sum kernel."""
        import torch
        from moe_ar_tools.baselines import triton_fused as tf

        def finalize(allreduce_in, idx, scale, shared):
            partial = torch.empty(idx.shape[0], allreduce_in.shape[1], dtype=allreduce_in.dtype,
                                  device=allreduce_in.device)
            return tf.gather_sum(partial, allreduce_in, idx, scale, shared,
                                 routed_scaling_factor=ROUTED_SCALING_FACTOR, num_warps=num_warps)
        return finalize

    def flashinfer_system(self, finalize, variant, shape: Shape, T: int, profile: str, data: dict,
                          system: str = "flashinfer") -> System:
        """The compiled finalize, then FlashInfer's norm kernel in place on one residual buffer per
        captured call (restored from residual_in before each checked replay)."""
        import torch
        p, sets, fi, calls = PROFILES[profile], data["sets"], self.flashinfer, data["calls"]
        residuals = [torch.empty(T, shape.hidden, dtype=self.dtype, device=self.device) for _ in range(calls)]
        pdl = self.capability >= (9, 0)  # FlashInfer's default (device_support_pdl)

        def restore():
            for j, buf in enumerate(residuals):
                buf.copy_(sets[j % len(sets)].residual)

        def call(j):
            x = sets[j % len(sets)]
            partial = finalize(x.allreduce_in, x.idx, x.scale, x.shared)
            if p.quant is None:
                fi.fused_add_rmsnorm(partial, residuals[j], x.norm_weight, EPS, pdl)
                return {"residual_out": residuals[j], "norm_out": partial}
            quant_out = torch.empty(T, shape.hidden, dtype=torch.float8_e4m3fn, device=self.device)
            fi.fused_add_rmsnorm_quant(quant_out, partial, residuals[j], x.norm_weight, data["fp8_value"], data["fp8"],
                                       EPS, pdl)
            return {"residual_out": residuals[j], "quant_out": quant_out}
        restore()
        return System(system, variant, call, restore=restore,
                      detail={"pdl": pdl, "writes_norm_out": p.quant is None})

    def build_systems(self, shape: Shape, T: int, profile: str, data: dict) -> tuple:
        """(systems to run, records of systems that cannot run here)."""
        from moe_ar_tools.baselines import flashinfer_norm, torch_chain, triton_fused
        cfg, p = self.cfg, PROFILES[profile]
        where = dict(profile=profile, tokens=T, hidden=shape.hidden, top_k=shape.top_k, shared=shape.shared,
                     mode=data["mode"])
        systems, nulls = [], []
        if "ours_pdl" in cfg.systems:
            systems.append(self.ours(shape, T, profile, data, pdl=True))
        if "ours" in cfg.systems:
            systems.append(self.ours(shape, T, profile, data))
            forced = self.programs_for(profile) if cfg.programs else []
            if len(forced) > 1:
                systems += [self.ours(shape, T, profile, data, program=name, variant=name) for name in forced]
        for system in ("triton_fused", "chain"):
            if system not in cfg.systems:
                continue
            why = triton_fused.unsupported(p.quant, p.scale_layout, self.device)
            if why:
                nulls.append(self.record(system=system, valid=False, reason=why, unavailable=True, **where))
                continue
            for nw in triton_fused.NUM_WARPS if system == "triton_fused" else CHAIN_NUM_WARPS:
                if system == "triton_fused":
                    systems.append(self.triton_fused_system(nw, shape, T, profile, data))
                    continue
                systems.append(self.triton_chain_system(nw, shape, T, profile, data))
                if self.flashinfer is not None and not flashinfer_norm.unsupported(p.quant, self.capability):
                    systems.append(self.flashinfer_system(self.triton_finalize(nw),
                                                          f"triton num_warps={nw} + flashinfer", shape, T, profile,
                                                          data, system="chain"))
        if "torch_eager" in cfg.systems:
            systems.append(self.chain_system("torch_eager", torch_chain.chain, None, T, profile, data))
        modes = [m for m in cfg.compile_modes if m == "dynamic" or cfg.static_compile(shape)]
        for system in ("torch_compile", "flashinfer"):
            if system not in cfg.systems:
                continue
            if system == "flashinfer":
                why = self.flashinfer_info.get("reason") or flashinfer_norm.unsupported(p.quant, self.capability)
                if why:
                    nulls.append(self.record(system=system, valid=False, reason=why, unavailable=True, **where))
                    continue
            for mode in modes:
                fns = self.compiled_fns(mode)
                if isinstance(fns, str) or (system, mode, profile) in self.failed:
                    why = f"torch.compile unavailable: {fns}" if isinstance(fns, str) else \
                        self.failed[(system, mode, profile)]
                    nulls.append(self.record(system=system, variant=mode, valid=False, reason=why, **where))
                elif system == "torch_compile":
                    systems.append(self.chain_system(system, fns["chain"], mode, T, profile, data))
                else:
                    systems.append(self.flashinfer_system(fns["finalize"], mode, shape, T, profile, data))
        return systems, nulls
