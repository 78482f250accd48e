"""EmulatedWorld: every rank of a world in this process, each rank its own buffers and stream, on one
GPU or spread over several. It proves correctness of world sizes 4, 8 and 16 without that many GPUs;
its timings say nothing about a real machine."""
from __future__ import annotations

import torch

from . import registry, table_sets
from .op import prepare_call
from .overlaps import check_rank_overlaps
from .rank_memory import RankMemory
from .workspace import WorkspaceBase, register_workspace
from .workspace_arguments import check_devices, check_workspace_arguments


class _EmulatedRank(WorkspaceBase):
    def __init__(self, world, rank, device_index, ranks_on_device):
        super().__init__()
        self._init_common(world.world_size, rank, world.max_tokens, world.hidden, world.dtype, device_index,
                          world.timeout_s, world.oneshot_max_tokens, ranks_on_device, world.vec_per_thread,
                          world.tables, world.boundaries)
        self._moe_ar_state.memory = RankMemory(device_index, self.buffer_elems, world.dtype.itemsize)
        self.world = world

    def check(self) -> None:
        self._moe_ar_state.ensure_open()
        super().check()

    def close(self) -> None:
        if not self._moe_ar_state.closed:
            self._forget()
            self._moe_ar_state.memory.free()


class EmulatedWorld:
    """All ranks of a world in this process: each rank its own buffers and stream.

    `devices` gives each rank's GPU (default: all on the current one); GPUs must reach each other
    directly (peer access is enabled here). Kernels of all ranks are launched on per-rank streams
    and sized so that every rank's grid is resident at once. Other arguments as for Workspace.
    Raises ValueError for a `devices` list of the wrong length, an entry that is not a visible GPU or
    GPUs without peer access, and as Workspace for the rest, before any allocation. If a rank's
    allocation fails, every rank's memory is freed and RuntimeError names the rank. Proves
    correctness of world sizes 4 and 8 without 4 or 8 GPUs; its timings say nothing about a real machine.
    `backend`: None or "ipc" (accepted for symmetry with Workspace; nothing crosses a process here).
    `tables` and `boundaries` as for Workspace; every rank must select alike (ValueError naming
    `devices` where the ranks' GPUs select different tables).
    """

    def __init__(self, world_size: int, max_tokens: int, hidden: int, dtype: torch.dtype, *, devices=None,
                 timeout_s: float = 10.0, oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None,
                 backend: str | None = None, tables=None, boundaries: dict | None = None):
        import cupy
        from cupy.cuda import runtime
        check_workspace_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
        table_sets.check_arguments(tables, boundaries)
        if world_size == 1:
            raise ValueError("world_size: 1 has no peers to emulate; use dispatch.LocalWorkspace(max_tokens, hidden, "
                             "dtype)")
        if backend is not None and (not isinstance(backend, str) or backend != "ipc"):
            raise ValueError(f"backend: {backend!r}; EmulatedWorld keeps every rank in this process and reaches the "
                             f"peers' buffers directly (no CUDA IPC, no symmetric memory): pass None or 'ipc'")
        world_size = int(world_size)
        devices = check_devices(devices, world_size)  # before any CUDA call
        if torch.cuda.device_count() == 0:
            raise ValueError("devices: no CUDA GPU is visible (torch.cuda.device_count() is 0); EmulatedWorld "
                             "runs every rank on a GPU")
        if None in devices:
            current = torch.cuda.current_device()
            devices = [current if d is None else d for d in devices]
        self.world_size, self.max_tokens, self.hidden, self.dtype = world_size, int(max_tokens), int(hidden), dtype
        self.timeout_s, self.oneshot_max_tokens = timeout_s, oneshot_max_tokens
        self.vec_per_thread = vec_per_thread
        self.tables, self.boundaries = tables, boundaries
        self.devices = devices
        self.workspaces = []
        for a in set(devices):  # peers on other GPUs are reached over NVLink
            for b in set(devices):
                if a != b:
                    with cupy.cuda.Device(a):
                        if not runtime.deviceCanAccessPeer(a, b):
                            raise ValueError(f"devices: GPU {a} cannot access GPU {b} directly")
                        try:
                            runtime.deviceEnablePeerAccess(b)
                        except runtime.CUDARuntimeError as e:
                            if "AlreadyEnabled" not in str(e) and "ALREADY_ENABLED" not in str(e).upper():
                                raise
        what = "rank 0"
        try:
            for r, d in enumerate(devices):
                what = f"rank {r}'s buffers on GPU {d}"
                self.workspaces.append(_EmulatedRank(self, r, d, devices.count(d)))
            what = "the per-rank streams"
            labels = {w.selection.label for w in self.workspaces}
            if len(labels) > 1:  # every rank must run the same regime for the same T
                raise ValueError(f"devices: the ranks' GPUs select different tables ({', '.join(sorted(labels))}); "
                                 f"pass tables= or boundaries= so that they agree, or use GPUs of one kind")
            ptrs = [w._moe_ar_state.memory.buffers for w in self.workspaces]
            ptrs += [0] * (registry.program_set().limits["max_world_size"] - world_size)
            for w in self.workspaces:
                w._moe_ar_state.peer_buffers = list(ptrs)
            self.streams = [torch.cuda.Stream(device=d) for d in devices]
        except Exception as e:
            for w in self.workspaces:  # every rank built so far
                w._moe_ar_state.memory.free(quiet=True)
                w._moe_ar_state.closed = True
            self.workspaces = []
            if isinstance(e, ValueError):
                raise
            raise RuntimeError(f"EmulatedWorld: allocating {what} failed ({type(e).__name__}: {e}); every "
                               f"rank's memory was freed") from e
        for w in self.workspaces:
            register_workspace(w)

    def _ensure_open(self) -> None:
        if any(w._moe_ar_state.closed for w in self.workspaces):
            raise ValueError("workspace: this world was closed")

    def run(self, per_rank_kwargs: list[dict]) -> list:
        """One call on every rank: `per_rank_kwargs[r]` holds rank r's keyword arguments of
        moe_finalize_allreduce (without the workspace). Every rank's call is checked before any is
        launched (ValueError naming the argument); the kernels run co-resident on per-rank streams,
        joined back to each device's current stream. Returns the list of MoeFinalizeOutputs.
        Capturable in a CUDA graph (single-device worlds)."""
        if len(per_rank_kwargs) != self.world_size:
            raise ValueError(f"per_rank_kwargs: {len(per_rank_kwargs)} entries for world size {self.world_size}")
        # Every rank's call is checked (and its outputs allocated on the caller's stream) before any
        # rank launches: a rank launched alone would wait for its peers until the deadline.
        calls = [prepare_call(w, dict(kw)) for w, kw in zip(self.workspaces, per_rank_kwargs)]
        check_rank_overlaps([c.args for c in calls])  # all ranks share one address space here
        for d, s in zip(self.devices, self.streams):
            s.wait_stream(torch.cuda.current_stream(d))
        outs = []
        for call, s in zip(calls, self.streams):
            with torch.cuda.stream(s):
                outs.append(call.launch())
        for d, s in zip(self.devices, self.streams):
            torch.cuda.current_stream(d).wait_stream(s)
        return outs

    def reset(self) -> None:
        """Bring every rank back to a clean state after a timeout (synchronizes the devices)."""
        self._ensure_open()
        for d in set(self.devices):
            torch.cuda.synchronize(d)
        for w in self.workspaces:
            w._moe_ar_state.memory.reset()

    def check(self) -> None:
        """Workspace.check() for every rank."""
        self._ensure_open()
        for w in self.workspaces:
            w.check()

    def close(self) -> None:
        """Release every rank's memory (synchronizes the devices)."""
        for d in set(self.devices):
            torch.cuda.synchronize(d)
        for w in self.workspaces:
            w.close()
