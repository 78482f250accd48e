"""Workspaces: each rank's Lamport buffers, device state and error words, and its peers' buffers.

    Workspace(group, max_tokens, hidden, dtype)       one process per GPU; peers over CUDA IPC
    EmulatedWorld(world_size, max_tokens, hidden, dtype, devices=[0, 0, 0, 0])
                                                      every rank in this process (tests, world sizes
                                                      4 and 8 without 4 or 8 GPUs)

Per rank, allocated once:

    buffers  3 x buffer_elems elements of dtype, filled with -0.0 (the Lamport sentinel);
             peers write into them, only this rank reads and clears them
    state    8 uint32 in device memory: call counter, extent written into each buffer, ...
    error    4 uint32 in host-mapped memory: the kernel records a timeout there and the host
             reads it on the next call without synchronizing
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import torch

from . import registry

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
SENTINEL_WORD = 0x80008000  # two -0.0 halves
STATE_WORDS = 8
STATE_POISONED = 5  # nonzero after a wait timed out: kernels write the poisoned output until reset()
STATE_BAD_ROWS = 6  # 64-bit: words 6 (low) and 7 (high)
ERROR_WORDS = 4
PHASES = {0: "none", 1: "reduce-scatter (waiting for peers' partials)",
          2: "all-gather (waiting for the owners' residual_out rows)", 3: "one-shot (waiting for peers' partials)"}
_CUDA_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x01

_live_workspaces = []  # weak bookkeeping for dispatch.check()
_ALL_TOKENS = 2**31 - 1


class RowSplit(NamedTuple):
    """Calls of up to `max_tokens` tokens spread a row over `threads` threads (a block), each
    holding up to `vec_per_thread` 16-byte vectors."""
    max_tokens: int
    threads: int
    vec_per_thread: int


def _split(nvec: int, vec_per_thread: int, max_tokens: int) -> RowSplit:
    threads = 32 * -(-nvec // (32 * vec_per_thread))  # whole warps
    return RowSplit(max_tokens, threads, -(-nvec // threads))


# What the kernel's 32-bit counts hold (templates/moe_finalize_allreduce.cuh.j2): T times small factors
# stays an int (the largest, FP8-group scale offsets: (H / 128 - 1) * roundup(T, 4) < 2^31), and a buffer's
# extent is kept in 16-byte vectors in a 32-bit state word.
MAX_TOKENS = 1 << 24
MAX_HIDDEN = 1 << 14
MAX_BUFFER_VECTORS = (1 << 32) - 1


def check_sizes(world_size: int, max_tokens: int, hidden: int, oneshot_max_tokens: int) -> None:
    """ValueError naming the argument when a workspace of these sizes needs a count the kernel keeps
    in 32 bits to hold more than it can."""
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden: {hidden}, more than the kernel's {MAX_HIDDEN}")
    if max_tokens > MAX_TOKENS:
        raise ValueError(f"max_tokens: {max_tokens}, more than the kernel's 32-bit counts allow ({MAX_TOKENS})")
    oneshot = world_size * oneshot_max_tokens * hidden
    twoshot = buffer_elems_for(world_size, max_tokens, hidden, 0)
    vectors = max(oneshot, twoshot) // 8
    if vectors > MAX_BUFFER_VECTORS:
        name = "oneshot_max_tokens" if oneshot > twoshot else "max_tokens"
        raise ValueError(f"{name}: {oneshot_max_tokens if oneshot > twoshot else max_tokens} tokens at hidden "
                         f"{hidden} and world size {world_size} need rotating buffers of {vectors} 16-byte vectors, "
                         f"more than the kernel's 32-bit extents hold ({MAX_BUFFER_VECTORS})")


def buffer_elems_for(world_size: int, max_tokens: int, hidden: int, oneshot_max_tokens: int) -> int:
    """Elements of one rotating buffer: the larger of the one-shot and two-shot layouts."""
    oneshot = world_size * oneshot_max_tokens * hidden
    per_owner = -(-max_tokens // world_size)
    twoshot = world_size * per_owner * hidden + max_tokens * hidden
    return max(oneshot, twoshot)


class _RankMemory:
    """One rank's buffers, state and error words, on one device."""

    def __init__(self, device_index: int, buffer_elems: int, elem_size: int):
        import cupy
        from cupy.cuda import runtime
        self.device_index = device_index
        self.buffer_bytes = 3 * buffer_elems * elem_size
        with cupy.cuda.Device(device_index):
            self.buffers = runtime.malloc(self.buffer_bytes)
            self.state = runtime.malloc(STATE_WORDS * 4)
        self.error_host = runtime.hostAlloc(ERROR_WORDS * 4, _CUDA_HOST_ALLOC_PORTABLE_MAPPED)
        # With unified addressing a mapped host allocation has the same address on the device.
        self.error = np.ctypeslib.as_array((ctypes.c_uint32 * ERROR_WORDS).from_address(self.error_host))
        self.reset()

    def reset(self) -> None:
        """Sentinel into every buffer, zero state and error words (the device is synchronized)."""
        import cupy
        from cupy.cuda import runtime
        with cupy.cuda.Device(self.device_index):
            mem = cupy.cuda.UnownedMemory(self.buffers, self.buffer_bytes, self, self.device_index)
            words = cupy.ndarray((self.buffer_bytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))
            words.fill(SENTINEL_WORD)
            runtime.memset(self.state, 0, STATE_WORDS * 4)
            runtime.deviceSynchronize()
        self.error[:] = 0

    def read_state(self) -> np.ndarray:
        import cupy
        from cupy.cuda import runtime
        out = np.zeros(STATE_WORDS, np.uint32)
        with cupy.cuda.Device(self.device_index):
            runtime.deviceSynchronize()
            runtime.memcpy(out.ctypes.data, self.state, STATE_WORDS * 4, runtime.memcpyDeviceToHost)
        return out

    def free(self) -> None:
        import cupy
        from cupy.cuda import runtime
        if self.buffers:
            with cupy.cuda.Device(self.device_index):
                runtime.deviceSynchronize()
                runtime.free(self.buffers)
                runtime.free(self.state)
            runtime.freeHost(self.error_host)
            self.buffers = self.state = self.error_host = 0


class _WorkspaceBase:
    """What a call needs from a rank's workspace; see Workspace and EmulatedWorld."""

    rank: int
    world_size: int

    def _init_common(self, world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                     oneshot_max_tokens, ranks_on_device, vec_per_thread=None):
        ps = registry.program_set()
        limits = ps.limits
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype} is not supported (use torch.float16 or torch.bfloat16)")
        if world_size not in ps.manifest["axes"]["world_sizes"]:
            raise ValueError(f"world_size: {world_size} is not generated (have {ps.manifest['axes']['world_sizes']})")
        if not isinstance(hidden, int) or hidden <= 0 or hidden % 16 or hidden > limits["max_hidden"]:
            raise ValueError(f"hidden: {hidden} must be a positive multiple of 16, at most {limits['max_hidden']}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: {max_tokens} must be a positive integer")
        if timeout_s is None or timeout_s < 0:
            raise ValueError(f"timeout_s: {timeout_s} must be >= 0 (0 disables the deadline)")
        self.world_size = world_size
        self.rank = rank
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = dtype
        self.dtype_name = DTYPES[dtype]
        self.device = torch.device("cuda", device_index)
        self.device_index = device_index
        self.timeout_ns = int(timeout_s * 1e9)
        self.oneshot_max_tokens = min(max_tokens, 1024) if oneshot_max_tokens is None else int(oneshot_max_tokens)
        check_sizes(world_size, max_tokens, hidden, self.oneshot_max_tokens)
        self.buffer_elems = buffer_elems_for(world_size, max_tokens, hidden, self.oneshot_max_tokens)
        self.ranks_on_device = ranks_on_device
        # Geometry: a row of H/8 16-byte vectors is spread over a block's threads, each holding up
        # to vec_per_thread of them. By default the split follows T (the manifest's limits): few
        # tokens get more threads a row (a shorter critical path), more tokens the fewest threads
        # (the most loads in flight a thread). Every rank of a call has the same T and so the same
        # split, and reduces each row in the same order. vec_per_thread fixes one split for every
        # call instead (the same on every rank; tuning experiments).
        nvec = hidden // 8
        if vec_per_thread is None:
            wide = _split(nvec, limits["max_vec_per_thread"], _ALL_TOKENS)
            few = _split(nvec, limits["few_tokens_vec_per_thread"], limits["few_tokens_max"])
            fits = few.threads <= limits["max_threads"] and few.threads != wide.threads
            self.row_splits = (few, wide) if fits else (wide,)
        else:
            if (isinstance(vec_per_thread, bool) or not isinstance(vec_per_thread, int)
                    or not 1 <= vec_per_thread <= limits["max_vec_per_thread"]):
                raise ValueError(f"vec_per_thread: {vec_per_thread!r}, expected 1..{limits['max_vec_per_thread']}")
            self.row_splits = (_split(nvec, vec_per_thread, _ALL_TOKENS),)
        if self.row_splits[-1].threads > limits["max_threads"]:
            raise ValueError(f"vec_per_thread: {vec_per_thread} vectors a thread needs {self.row_splits[-1].threads} "
                             f"threads for hidden {hidden}, more than {limits['max_threads']}")
        self._launchers = {}
        self._closed = False
        # Fault injection for tests only: > 0 makes this rank's kernels send that many phase-1 work
        # units and stop (tests/test_gpu_reliability.py). Never set it in real use.
        self._fault_stop_after_units = 0
        _live_workspaces.append(self)

    def row_split_index(self, T: int) -> int:
        """The index in row_splits of the split a call of T tokens uses."""
        i = 0
        while T > self.row_splits[i].max_tokens:
            i += 1
        return i

    def _check_error_words(self) -> None:
        err = self._memory.error
        if err[0]:
            raise RuntimeError(
                f"moe_finalize_allreduce: rank {int(err[2])} timed out in phase {PHASES.get(int(err[1]), err[1])} "
                f"(a peer did not take part in a call within {self.timeout_ns / 1e9:g} s). The workspace's buffers "
                f"are now inconsistent: call reset() on every rank's workspace (or rebuild them) before the next call.")

    def check(self) -> None:
        """Raise RuntimeError if a kernel of this rank timed out; report skipped out-of-range rows."""
        self._check_error_words()
        state = self._memory.read_state()
        bad_rows = int(state[STATE_BAD_ROWS]) | int(state[STATE_BAD_ROWS + 1]) << 32
        if bad_rows:
            raise RuntimeError(f"moe_finalize_allreduce: rank {self.rank}: routes had an expanded_idx_to_permuted_idx "
                               f"entry >= allreduce_in.shape[0]; they were skipped ({bad_rows} "
                               f"16-byte row loads left out since the workspace was made or reset)")

    @property
    def peer_buffer_ptrs(self) -> list[int]:
        return self._peer_buffers

    def _ensure_open(self):
        if self._closed:
            raise ValueError("workspace: this workspace was closed")


class Workspace(_WorkspaceBase):
    """One rank of a real process group (one process per GPU); peers' buffers over CUDA IPC.

    Collective: every rank of `group` constructs it together, on its current CUDA device. `group`
    is used for the rendezvous and never the default group in its place.

    Arguments: `max_tokens` (T of the largest call), `hidden` (H: a multiple of 16, at most 16384),
    `dtype` (torch.float16 or torch.bfloat16), `timeout_s` (deadline of any wait on a peer;
    0 disables it), `oneshot_max_tokens` (one-shot buffer capacity, default min(max_tokens, 1024)),
    `vec_per_thread` (16-byte vectors of a row per thread, 1..4, for every call; default None: per
    call, 2 up to the manifest's few_tokens_max (256) tokens and 4 above; every rank must pass the same).
    Raises ValueError naming the argument for a missing group, an unsupported dtype, a world size
    with no programs (2, 4, 8 are generated), a bad hidden, max_tokens or timeout_s. After close(),
    a call with this workspace raises ValueError.
    """

    def __init__(self, group, max_tokens: int, hidden: int, dtype: torch.dtype, *, timeout_s: float = 10.0,
                 oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None):
        import torch.distributed as dist
        from cupy.cuda import runtime
        if group is None:
            raise ValueError("group: a process group is required (pass dist.group.WORLD to mean the default one)")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        device_index = torch.cuda.current_device()
        self._init_common(world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                          oneshot_max_tokens, ranks_on_device=1, vec_per_thread=vec_per_thread)
        self.group = group
        self._memory = _RankMemory(device_index, self.buffer_elems, dtype.itemsize)
        import cupy
        with cupy.cuda.Device(device_index):
            handle = bytes(runtime.ipcGetMemHandle(self._memory.buffers))
        handles = [None] * world_size
        dist.all_gather_object(handles, (rank, handle), group=group)
        self._opened = []
        self._peer_buffers = [0] * 8
        with cupy.cuda.Device(device_index):
            for r, h in handles:
                if r == rank:
                    self._peer_buffers[r] = self._memory.buffers
                else:
                    ptr = runtime.ipcOpenMemHandle(h, _IPC_LAZY_ENABLE_PEER_ACCESS)
                    self._opened.append(ptr)
                    self._peer_buffers[r] = ptr
        dist.barrier(group=group)

    def reset(self) -> None:
        """Collective: bring the group back to a clean state after a timeout."""
        import torch.distributed as dist
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._memory.reset()
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Collective: release the buffers and the peers' IPC mappings."""
        if self._closed:
            return
        import cupy
        import torch.distributed as dist
        from cupy.cuda import runtime
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # no peer may still write into our buffers
        with cupy.cuda.Device(self.device_index):
            for ptr in self._opened:
                runtime.ipcCloseMemHandle(ptr)
        self._opened = []
        dist.barrier(group=self.group)
        self._memory.free()
        self._closed = True
        self._launchers.clear()
        if self in _live_workspaces:
            _live_workspaces.remove(self)


class _EmulatedRank(_WorkspaceBase):
    def __init__(self, world, rank, device_index, ranks_on_device):
        self._init_common(world.world_size, rank, world.max_tokens, world.hidden, world.dtype, device_index,
                          world.timeout_s, world.oneshot_max_tokens, ranks_on_device, world.vec_per_thread)
        self._memory = _RankMemory(device_index, self.buffer_elems, world.dtype.itemsize)
        self._peer_buffers = [0] * 8
        self.world = world

    def close(self) -> None:
        if not self._closed:
            self._memory.free()
            self._closed = True
            self._launchers.clear()
            if self in _live_workspaces:
                _live_workspaces.remove(self)


class EmulatedWorld:
    """All ranks of a world in this process: each rank its own buffers and stream.

    `devices` gives each rank's GPU (default: all on the current one); GPUs must reach each other
    directly (peer access is enabled here). Kernels of all ranks are launched on per-rank streams
    and sized so that every rank's grid is resident at once. Other arguments as for Workspace.
    Raises ValueError for a `devices` list of the wrong length or GPUs without peer access, and as
    Workspace for the rest. Proves correctness of world sizes 4 and 8 without 4 or 8 GPUs; its
    timings say nothing about a real machine.
    """

    def __init__(self, world_size: int, max_tokens: int, hidden: int, dtype: torch.dtype, *, devices=None,
                 timeout_s: float = 10.0, oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None):
        import cupy
        from cupy.cuda import runtime
        if devices is None:
            devices = [torch.cuda.current_device()] * world_size
        devices = [torch.device(d).index if not isinstance(d, int) else d for d in devices]
        if len(devices) != world_size:
            raise ValueError(f"devices: {len(devices)} entries for world_size {world_size}")
        self.world_size, self.max_tokens, self.hidden, self.dtype = world_size, max_tokens, hidden, dtype
        self.timeout_s, self.oneshot_max_tokens = timeout_s, oneshot_max_tokens
        self.vec_per_thread = vec_per_thread
        self.devices = devices
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
        self.workspaces = [_EmulatedRank(self, r, d, devices.count(d)) for r, d in enumerate(devices)]
        ptrs = [w._memory.buffers for w in self.workspaces]
        for w in self.workspaces:
            w._peer_buffers = ptrs + [0] * (8 - world_size)
        self.streams = [torch.cuda.Stream(device=d) for d in devices]

    def run(self, per_rank_kwargs: list[dict]) -> list:
        """One call on every rank: `per_rank_kwargs[r]` holds rank r's keyword arguments of
        moe_finalize_allreduce (without the workspace). Every rank's call is checked before any is
        launched (ValueError naming the argument); the kernels run co-resident on per-rank streams,
        joined back to each device's current stream. Returns the list of MoeFinalizeOutputs.
        Capturable in a CUDA graph (single-device worlds)."""
        from .op import prepare_call
        if len(per_rank_kwargs) != self.world_size:
            raise ValueError(f"per_rank_kwargs: {len(per_rank_kwargs)} entries for world size {self.world_size}")
        # Every rank's call is checked (and its outputs allocated on the caller's stream) before any
        # rank launches: a rank launched alone would wait for its peers until the deadline.
        calls = [prepare_call(w, dict(kw)) for w, kw in zip(self.workspaces, per_rank_kwargs)]
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
        for d in set(self.devices):
            torch.cuda.synchronize(d)
        for w in self.workspaces:
            w._memory.reset()

    def check(self) -> None:
        """Workspace.check() for every rank."""
        for w in self.workspaces:
            w.check()

    def close(self) -> None:
        """Release every rank's memory (synchronizes the devices)."""
        for d in set(self.devices):
            torch.cuda.synchronize(d)
        for w in self.workspaces:
            w.close()


def check() -> None:
    """Raise RuntimeError naming the rank and phase if any live workspace's kernel timed out, or if
    routes with an index >= allreduce_in.shape[0] were skipped. Synchronizes the devices: call it
    off the hot path (between steps, in tests)."""
    for w in list(_live_workspaces):
        w.check()
