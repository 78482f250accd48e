"""The systems world size 2+ times besides the fused op: the unfused steps (torch ops around an NCCL
or a torch symmetric-memory all-reduce, eager or under torch.compile) and the symmetric-memory
buffer."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

from moe_ar_tools.bench.inputs import InputSet
from moe_ar_tools.bench.torch_ops import epilogue_into, finalize_into


@dataclass
class System:
    """One competitor at one point: a step function (one call on input set i) and its outputs."""
    name: str                      # the record's `system`
    regime: str                    # exchange regime for the NVLink bytes: one_shot / two_shot
    call: Callable[[int], None]
    outputs: list                  # per input set: dict of output tensors
    variant: Optional[str] = None  # symm+torch: one_shot / two_shot
    program: Optional[str] = None  # the generated program the call runs
    graph: object = None
    checks: dict = field(default_factory=dict)
    detail: dict = field(default_factory=dict)  # extra record fields

    @property
    def label(self) -> str:
        return self.name + (f"/{self.variant}" if self.variant else "")


def torch_finalize(inputs: InputSet, partial, fn=finalize_into) -> None:
    """finalize_into on an input set; fn: its compiled form for the +compiled baselines."""
    fn(partial, inputs.allreduce_in, inputs.idx, inputs.scale, inputs.shared)


def torch_epilogue(reduced, inputs: InputSet, out: dict, fn=epilogue_into) -> None:
    """epilogue_into on an input set; fn: its compiled form for the +compiled baselines."""
    fn(out["residual_out"], out["norm_out"], reduced, inputs.residual, inputs.norm_weight)


def compiled_fns(backend: str = "inductor") -> tuple:
    """(finalize, epilogue): finalize_into and epilogue_into under torch.compile, fullgraph and
    static shapes (compiled at each new shape's first call). Dynamo keeps one cache per code
    object, so its recompile limit is raised to hold every shape of a sweep: hitting it would
    silently fall back to eager."""
    import torch
    import torch._dynamo.config as dynamo_config
    for name, least in (("recompile_limit", 4096), ("cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 65536), ("accumulated_cache_size_limit", 65536)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), least))
    return tuple(torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
                 for fn in (finalize_into, epilogue_into))


class SymmAllReduce:
    """torch symmetric memory (peer loads/stores; multicast disabled) for one hidden size: one
    symmetric buffer of [max_tokens, hidden] per rank, rendezvoused on the group."""

    def __init__(self, group, max_tokens: int, hidden: int, dtype, device):
        import torch
        import torch.distributed._symmetric_memory as symm_mem
        ops = getattr(torch.ops, "symm_mem", None)
        missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
        missing += [f"torch.ops.symm_mem.{n}" for n in ("one_shot_all_reduce_out", "two_shot_all_reduce_")
                    if ops is None or not hasattr(ops, n)]
        if missing:
            raise RuntimeError(f"this torch lacks {', '.join(missing)}")
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty((max_tokens, hidden), dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.ops = ops
        self.backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None
