"""World size 1: the workspace of a call with nothing to exchange.

    ws = dispatch.LocalWorkspace(max_tokens, hidden, dtype)            # on the current device
    out = dispatch.moe_finalize_allreduce(ws, allreduce_in=..., ...)   # the call of every world size

For tensor parallelism 1, attention data parallelism with wide expert parallelism (the all-to-all
combine has summed the routed rows already) and one-GPU MoE models: the same tail (finalize,
residual add, RMSNorm, quantized output) in one launch, with no process group. The local programs
(kernels/local.cuh) keep each token's partial in fp32 up to the residual add and round once
(docs/operation.md, "World size 1").

Nothing is exchanged, so there are no buffers, no peers, no deadline and no poisoned workspace: the
memory is the 8 device state words, of which the kernel uses the count of skipped out-of-range routes
(check() reports them). dispatch.Workspace(group) with a group of one process builds the same memory
(LocalMemory) without a rendezvous.
"""
from __future__ import annotations

import torch

from . import table_sets
from .rank_memory import LocalMemory
from .workspace import WorkspaceBase, register_workspace
from .workspace_arguments import check_workspace_arguments, device_entry
from .workspace_sizes import check_sizes


def device_index_of(device) -> int:
    """The CUDA device index of `device`: None (the current device), an int, "cuda", "cuda:i" or a
    torch.device. ValueError naming `device` for anything else or a GPU that is not visible."""
    index = device_entry(device, "device")
    if index is None:
        if torch.cuda.device_count() == 0:
            raise ValueError("device: None (the current device), but no CUDA device is visible")
        return torch.cuda.current_device()
    return index


class LocalWorkspace(WorkspaceBase):
    """The workspace of world size 1 (rank 0 of 1), on one GPU, with no process group.

    Arguments: `max_tokens` (T of the largest call), `hidden` (H: a multiple of 16, at most 16384),
    `dtype` (torch.float16 or torch.bfloat16), `device` (None: the current device; an index, "cuda:i"
    or a torch.device), `vec_per_thread` (16-byte vectors of a row a thread, 1..4, for every call;
    default None: per call, as for Workspace), `tables` and `boundaries` (the selection tables, as for
    Workspace). A bad argument is a ValueError naming it, raised before anything is allocated. Allocates the 8 device state words, nothing else.

    Calls as at any world size (dispatch.moe_finalize_allreduce, the torch ops through
    dispatch.workspace_handle, the FlashInfer-style entry with world_rank 0 and world_size 1).
    check() raises RuntimeError if routes with an index >= allreduce_in.shape[0] were skipped;
    reset() zeroes that count; close() (or leaving a `with` block) releases the memory, after which a
    call raises ValueError.
    """

    def __init__(self, max_tokens: int, hidden: int, dtype: torch.dtype, *, device=None,
                 vec_per_thread: int | None = None, tables=None, boundaries: dict | None = None):
        super().__init__()  # no peers: every peer buffer null
        check_workspace_arguments(1, max_tokens, hidden, dtype, 0, None, vec_per_thread)
        table_sets.check_arguments(tables, boundaries)
        check_sizes(1, int(max_tokens), int(hidden), 0)
        device_index = device_index_of(device)
        self._init_common(1, 0, max_tokens, hidden, dtype, device_index, 0, None, ranks_on_device=1,
                          vec_per_thread=vec_per_thread, tables=tables, boundaries=boundaries)
        self._moe_ar_state.memory = LocalMemory(device_index)
        register_workspace(self)

    def reset(self) -> None:
        """Zero the count of skipped routes (synchronizes the device)."""
        self._moe_ar_state.ensure_open()
        self._moe_ar_state.memory.reset()

    def check(self) -> None:
        self._moe_ar_state.ensure_open()
        super().check()

    def close(self) -> None:
        """Release the state words (after this device's kernels have finished); idempotent."""
        if self._moe_ar_state.closed:
            return
        self._forget()
        self._moe_ar_state.memory.free()

    def __enter__(self) -> "LocalWorkspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
