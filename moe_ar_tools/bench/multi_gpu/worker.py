"""One rank's worker: its device and process groups, the CPU agreement over gloo, and the setup the
points share."""
from __future__ import annotations

from moe_ar_tools.bench.config import FALLBACK_L2_BYTES, PROFILES, Config
from moe_ar_tools.bench.inputs import InputSet
from moe_ar_tools.bench.multi_gpu.config import COMPILED_SYSTEMS
from moe_ar_tools.bench.multi_gpu.fp8_quant import Fp8QuantKernel
from moe_ar_tools.bench.multi_gpu.systems import SymmAllReduce, compiled_fns, torch_epilogue, torch_finalize
from moe_ar_tools.bench.outputs import alloc_outputs


class Worker:
    """One rank's part of the sweep. Every collective decision (skip, stop) is agreed over gloo so
    that all ranks enqueue the same sequence of communicating kernels. This part holds the rank's
    device and groups, the agreement helpers and what the points share (programs, workspaces,
    symmetric memory, the compiled baselines, the FP8 kernel); PointRunner measures one point and
    Bench runs the sweep."""

    def __init__(self, cfg: Config, rank: int, gloo):
        import torch
        import torch.distributed as dist
        self.cfg, self.rank, self.gloo = cfg, rank, gloo
        self.group = dist.group.WORLD
        self.W = cfg.world
        self.device = torch.device("cuda", rank)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        self.max_tokens = max(cfg.tokens)
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)
        self.records: list = []
        self.skipped: list = []
        self.workspaces: dict = {}
        self.symm: dict = {}
        self.compiled = None        # (finalize, epilogue) under torch.compile, made at first use
        self.compile_failed = False  # a compile failure turns the +compiled baselines off for the run
        self.truncated = False

    # -- agreement helpers (CPU collectives; never touch the GPU stream) --
    def all_true(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist
        every = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.gloo)
        return bool(every.item())

    def gather(self, obj) -> list:
        import torch.distributed as dist
        out = [None] * self.W
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def broadcast(self, obj):
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.gloo)
        return box[0]

    def all_gather(self, t):
        """[W, *t.shape]: every rank's t, over the device group (a tensor collective)."""
        import torch
        import torch.distributed as dist
        out = torch.empty(self.W * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, t.contiguous().reshape(-1), group=self.group)
        return out.view(self.W, *t.shape)

    def barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.gloo)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def skip(self, reason: str, **where) -> None:
        if self.rank == 0:
            self.skipped.append(dict(where, reason=reason))

    # -- setup --
    def programs_for(self, profile: str) -> list[str]:
        import dispatch
        from dispatch.op import profile_for_quant
        manifest_profile = profile_for_quant(PROFILES[profile])  # the manifest names profiles by quant=
        out = []
        for name in dispatch.programs():
            info = dispatch.program_info(name)
            if (info["dtype"], info["world_size"], info["profile"]) == (self.cfg.dtype, self.W, manifest_profile):
                out.append(name)
        return out

    def compile_programs(self) -> list:
        """Compile (or load from the disk cache) every program the sweep may run: each rank
        compiles its share, then every rank loads all of them (from the cache)."""
        import dispatch
        names = sorted({n for p in self.cfg.profiles for n in self.programs_for(p)})
        mine = dispatch.warmup(names[self.rank::self.W], device_index=self.rank)
        self.barrier()
        dispatch.warmup(names, device_index=self.rank)
        self.barrier()
        return [i for infos in self.gather(mine) for i in infos]

    def workspace(self, hidden: int):
        import dispatch
        if hidden not in self.workspaces:
            # the sweeps force the one-shot up to 1,024 tokens (to fit the tables): more than the
            # default capacity, which is the committed tables' one-shot boundary
            self.workspaces[hidden] = dispatch.Workspace(self.group, self.max_tokens, hidden, self.dtype,
                                                         timeout_s=self.cfg.timeout_s,
                                                         oneshot_max_tokens=min(self.max_tokens, 1024),
                                                         vec_per_thread=self.cfg.vec_per_thread)
        return self.workspaces[hidden]

    def fp8_quant_kernel(self) -> "Fp8QuantKernel":
        if getattr(self, "_fp8_quant", None) is None:
            self._fp8_quant = Fp8QuantKernel(self.device.index)
        return self._fp8_quant

    def symm_for(self, hidden: int):
        """The symmetric-memory buffer for this hidden, or None (the reason is recorded once)."""
        if hidden not in self.symm:
            try:
                obj, err = SymmAllReduce(self.group, self.max_tokens, hidden, self.dtype, self.device), None
            except Exception as e:  # noqa: BLE001 - any failure means: no symm baseline here
                obj, err = None, f"{type(e).__name__}: {e}"
            if not self.all_true(obj is not None):
                errs = [e for e in self.gather(err) if e]
                self.skip("symmetric memory unavailable: " + "; ".join(errs[:2]),
                          system="symm+torch,symm+compiled", hidden=hidden)
                obj = None
            self.symm[hidden] = obj
        return self.symm[hidden]

    def compiled_for(self, T: int, H: int, inputs: InputSet, where: dict):
        """The compiled (finalize, epilogue), compiled for this point's shapes by one call on scratch
        tensors (setup, outside the timing), or None when torch.compile failed on some rank (the
        reason recorded once; the +compiled baselines are then off for the rest of the run)."""
        import torch
        if self.compile_failed:
            return None
        err = None
        try:
            if self.compiled is None:
                self.compiled = compiled_fns()
            partial = torch.empty(T, H, dtype=self.dtype, device=self.device)
            outs = alloc_outputs(T, H, self.dtype, None, self.device)
            torch_finalize(inputs, partial, self.compiled[0])
            torch_epilogue(partial, inputs, outs, self.compiled[1])
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - any failure means: no compiled baseline here
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not self.all_true(err is None):
            errs = [e for e in self.gather(err) if e]
            self.skip("torch.compile failed (compiled baselines off for the rest of the run): " +
                      "; ".join(errs[:2]), system=",".join(COMPILED_SYSTEMS), **where)
            self.compile_failed = True
            return None
        return self.compiled
