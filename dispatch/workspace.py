"""Workspaces: what a call needs from a rank (WorkspaceBase) and one rank of a real process group
(Workspace), with the registry of live workspaces that dispatch.check() reads.

    Workspace(group, max_tokens, hidden, dtype)       one process per GPU; peers over CUDA IPC
    Workspace(..., backend="symm_mem")                the buffers from torch symmetric memory instead
                                                      ("auto": where every rank can, else CUDA IPC)
    EmulatedWorld(world_size, max_tokens, hidden, dtype, devices=[0, 0, 0, 0])
                                                      every rank in this process (emulated_world.py)

The parts, one concern each: workspace_arguments.py (argument checks), workspace_sizes.py (buffer
sizes, the kernel's 32-bit limits, the row split), backend_facts.py (whether torch symmetric memory
is usable, the GPU's NVLink domain), rendezvous.py (the ranks exchange and compare what they must
agree on before anything is allocated; every later fallible step ends in an exchange of its status,
so a rank that fails makes every rank raise at once), rank_memory.py (one rank's buffers, state and
error words, and the two buffer backends: cudaMalloc with CUDA IPC, torch symmetric memory),
workspace_state.py (what the package's modules keep and read of a workspace: its plans, launchers,
memory, peers' buffers, open or closed).
"""
from __future__ import annotations

import warnings
import weakref

import torch

from . import registry, table_sets
from .backend_facts import nvlink_domain, symm_mem_unavailable
from .rank_memory import LocalMemory, RankMemory, SymmMemBuffers, state_word
from .rendezvous import (RankDescriptor, RendezvousOk, choose_backend, exchange_status, gather_status, gpu_identity,
                         host_identity, program_set_sha256, raise_failures, rendezvous, rendezvous_attempt)
from .workspace_arguments import DTYPES, check_backend, check_workspace_arguments, timeout_ns_from
from .workspace_sizes import ALL_TOKENS, buffer_elems_for, check_sizes, cluster_row_split, row_split
from .workspace_state import WorkspaceState

_IPC_LAZY_ENABLE_PEER_ACCESS = 0x01

_live_workspaces = weakref.WeakSet()  # every constructed, not yet closed workspace, for dispatch.check()


def register_workspace(workspace) -> None:
    _live_workspaces.add(workspace)


class WorkspaceBase:
    """What a call needs from a rank's workspace; see Workspace and EmulatedWorld."""

    rank: int
    world_size: int

    def __init__(self):
        # the package's state of this workspace (dispatch/workspace_state.py): its one door for other modules
        self._moe_ar_state = WorkspaceState()

    def _init_common(self, world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                     oneshot_max_tokens, ranks_on_device, vec_per_thread=None, tables=None, boundaries=None):
        check_workspace_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
        limits = registry.program_set().limits
        world_size, max_tokens, hidden = int(world_size), int(max_tokens), int(hidden)
        vec_per_thread = None if vec_per_thread is None else int(vec_per_thread)
        self.world_size = world_size
        self.rank = rank
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = dtype
        self.dtype_name = DTYPES[dtype]
        self.device = torch.device("cuda", device_index)
        self.device_index = device_index
        self.timeout_ns = timeout_ns_from(timeout_s)
        # the selection boundaries of every call, chosen here once: the table set for this device, a
        # user's set, the boundaries= override (dispatch/table_sets.py)
        self.selection = table_sets.for_workspace(self.dtype_name, world_size, hidden, dtype.itemsize, device_index,
                                                  tables, boundaries)
        # default: the largest one-shot boundary of the tables, so no automatic call loses its one-shot
        # and no memory is held for one-shot calls only a forced program= would make
        # none at world size 1 (nothing is exchanged)
        oneshot_field = dict(registry.program_set().ladder)[registry.ONESHOT_REGIME]
        if oneshot_max_tokens is not None:
            self.oneshot_max_tokens = int(oneshot_max_tokens)
        else:
            self.oneshot_max_tokens = 0 if world_size == 1 else min(max_tokens,
                                                                    self.selection.oneshot_capacity(oneshot_field))
        self.vec_per_thread = vec_per_thread
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
            wide = row_split(nvec, limits["max_vec_per_thread"], ALL_TOKENS)
            few = row_split(nvec, limits["few_tokens_vec_per_thread"], limits["few_tokens_max"])
            fits = few.threads <= limits["max_threads"] and few.threads != wide.threads
            self.row_splits = (few, wide) if fits else (wide,)
        else:
            self.row_splits = (row_split(nvec, vec_per_thread, ALL_TOKENS),)
        if self.row_splits[-1].threads > limits["max_threads"]:
            raise ValueError(f"vec_per_thread: {vec_per_thread} vectors a thread needs {self.row_splits[-1].threads} "
                             f"threads for hidden {hidden}, more than {limits['max_threads']}")
        self._moe_ar_state.timeout_ns = self.timeout_ns  # for its timeout message

    def _forget(self) -> None:
        """Closed: no plan, launcher or dispatch.check() entry refers to this workspace any more
        (its memory is released by the caller)."""
        self._moe_ar_state.forget()
        _live_workspaces.discard(self)

    def row_splits_for(self, regime: str) -> tuple:
        """The row splits a program of `regime` runs. World size 1's latency layout (`local`) keeps
        the few-tokens split at every T where it fits a block: its all-loads path (2 vectors a thread)
        is faster than its by-vector path under the wide split at every T measured on an H200
        (bench_results/world_size_1/row_split/). Its streaming layout keeps the wide split at every T:
        the fewest threads a block, so two blocks fit a multiprocessor
        (bench_results/world_size_1/two_blocks/). A row of cluster_round_min_warps warps or more takes a
        multiple of cluster_max_blocks warps (cluster_row_split); the cluster layout itself, up to
        its token limit (launcher.py, cluster_max_tokens_for), has its own split (cluster_layout_split). A split fixed by
        vec_per_thread is every program's and layout's."""
        if self.vec_per_thread is None and len(self.row_splits) == 2:
            if regime == registry.LOCAL_LATENCY_REGIME:
                limits = registry.program_set().limits
                few = cluster_row_split(self.row_splits[0], self.hidden // 8, limits["cluster_round_min_warps"],
                                        limits["cluster_max_blocks"], limits["max_threads"])
                return (few._replace(max_tokens=ALL_TOKENS),)
            if regime == registry.LOCAL_STREAMING_REGIME:
                return (self.row_splits[1],)
        return self.row_splits

    def row_split_index(self, T: int) -> int:
        """The index in row_splits of the split a call of T tokens uses."""
        i = 0
        while T > self.row_splits[i].max_tokens:
            i += 1
        return i

    def check(self) -> None:
        """Raise RuntimeError if a kernel of this rank timed out; report skipped out-of-range rows."""
        self._moe_ar_state.check_error_words()
        state = self._moe_ar_state.memory.read_state()
        low = state_word("kBadRows")  # 64-bit: this word and the next
        bad_rows = int(state[low]) | int(state[low + 1]) << 32
        if bad_rows:
            raise RuntimeError(f"moe_finalize_allreduce: rank {self.rank}: routes had an expanded_idx_to_permuted_idx "
                               f"entry >= allreduce_in.shape[0]; they were skipped ({bad_rows} "
                               f"16-byte row loads left out since the workspace was made or reset)")

    @property
    def peer_buffer_ptrs(self) -> list[int]:
        return self._moe_ar_state.peer_buffers


class Workspace(WorkspaceBase):
    """One rank of a real process group (one process per GPU); peers' buffers over CUDA IPC or torch
    symmetric memory (`backend`).

    Collective: every rank of `group` constructs it together, on its current CUDA device. `group`
    is used for every exchange and never the default group in its place.

    Arguments: `max_tokens` (T of the largest call), `hidden` (H: a multiple of 16, at most 16384),
    `dtype` (torch.float16 or torch.bfloat16), `timeout_s` (deadline of any wait on a peer, 0..86400;
    0 disables it), `oneshot_max_tokens` (one-shot buffer capacity, 1..max_tokens, default
    min(max_tokens, B): B the largest one-shot boundary, in tokens, of the workspace's selection
    tables (any output profile); a forced one-shot program= above it needs it larger),
    `vec_per_thread` (16-byte vectors of a row per thread, 1..4, for every call; default None: per
    call, 2 up to the manifest's few_tokens_max (256) tokens and 4 above),
    `backend` ("ipc", the default: cudaMalloc and CUDA IPC, one host; "symm_mem": torch symmetric
    memory, one host or one multi-node NVLink domain; "auto": "symm_mem" where every rank can use
    it, else "ipc" with a RuntimeWarning saying why). `backend` and `backend_reason` hold the choice.
    `tables` (a table set file written by `gen-programs tune`; default $MOE_AR_TABLES, else the
    committed set for the device) and `boundaries` ({ladder field: tokens} pinned by hand) decide
    the selection boundaries (dispatch/table_sets.py; `dispatch.selection_info(ws)`).

    Before allocating anything the ranks exchange a RankDescriptor: every rank must pass the same
    arguments and have the same buffer size, programs (manifest hash) and world size, each on its own
    GPU, on hosts the chosen backend can span. Any difference, and a bad argument on any rank, is the
    same ValueError on every rank, naming the field or argument. A rank whose allocation, CUDA IPC
    step or torch rendezvous fails makes every rank raise RuntimeError naming the step and the rank;
    every rank frees what it took. After close(), a call with this workspace raises ValueError.
    """

    def __init__(self, group, max_tokens: int, hidden: int, dtype: torch.dtype, *, timeout_s: float = 10.0,
                 oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None, backend: str = "ipc",
                 tables=None, boundaries: dict | None = None):
        rank, world_size = self._group_rank(group)
        super().__init__()
        self.group = group
        self._opened = []
        self.backend = self.backend_reason = None
        if world_size == 1:  # nothing to exchange: LocalWorkspace's memory, no buffers, no rendezvous
            check_backend(backend)
            table_sets.check_arguments(tables, boundaries)
            self._init_common(1, 0, max_tokens, hidden, dtype, torch.cuda.current_device(), timeout_s,
                              oneshot_max_tokens, ranks_on_device=1, vec_per_thread=vec_per_thread, tables=tables,
                              boundaries=boundaries)
            self.backend, self.backend_reason = "local", "world size 1: nothing is exchanged (dispatch/local.py)"
            self._moe_ar_state.memory = LocalMemory(self.device_index)
            register_workspace(self)
            return
        # 1. Local checks (no allocation), then the descriptors: a bad argument or a disagreement on
        #    any rank is the same error on every rank, before anything is allocated.
        descriptor, error, asked = None, None, None
        try:
            check_workspace_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
            table_sets.check_arguments(tables, boundaries)
            asked = check_backend(backend)
            device_index = torch.cuda.current_device()
            self._init_common(world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                              oneshot_max_tokens, ranks_on_device=1, vec_per_thread=vec_per_thread, tables=tables,
                              boundaries=boundaries)
            gpu = gpu_identity(device_index)
            unavailable = note = "not checked (backend 'ipc')"
            domain = ""
            if asked != "ipc":
                unavailable = symm_mem_unavailable(group, device_index)
                domain, note = nvlink_domain(device_index, gpu)
            descriptor = RankDescriptor(
                world_size=world_size, program_set=program_set_sha256(), dtype=str(dtype), hidden=self.hidden,
                max_tokens=self.max_tokens, oneshot_max_tokens=self.oneshot_max_tokens,
                vec_per_thread=self.vec_per_thread, timeout_ns=self.timeout_ns,
                buffer_bytes=3 * self.buffer_elems * dtype.itemsize, host=host_identity(), gpu=gpu,
                backend=asked, symm_mem_unavailable=unavailable, nvlink_domain=domain, nvlink_note=note,
                selection=self.selection.label)
        except Exception as e:
            error = e
        self._moe_ar_state.closed = True  # until every rank has built it
        descriptors = rendezvous(group, descriptor, error)
        self.backend, self.backend_reason = choose_backend(descriptors)  # the same on every rank
        if asked == "auto" and self.backend == "ipc":
            warnings.warn(f"Workspace: {self.backend_reason}", RuntimeWarning, stacklevel=2)
        # 2. Allocation, 3. the peers' buffers: each step ends in an exchange of its status instead of
        #    a barrier, so one rank's failure reaches every rank at once; each frees what it took.
        if self.backend == "ipc":
            self._build_ipc(device_index, dtype)
        else:
            self._build_symm_mem(device_index, dtype)
        self._moe_ar_state.closed = False
        register_workspace(self)

    def _build_ipc(self, device_index: int, dtype) -> None:
        import cupy
        from cupy.cuda import runtime
        group, error, state = self.group, None, self._moe_ar_state
        try:
            handle = None
            try:
                state.memory = RankMemory(device_index, self.buffer_elems, dtype.itemsize)
                with cupy.cuda.Device(device_index):
                    handle = bytes(runtime.ipcGetMemHandle(state.memory.buffers))
            except Exception as e:
                error = e
            handles = exchange_status(group, "allocating the buffers", error, handle)  # nothing mapped yet
            error = rendezvous_attempt(lambda: self._open_peers(handles))
            opened = gather_status(group, "opening the peers' buffers over CUDA IPC", error)
        except BaseException:
            self._release(quiet=True)  # a failed allocation, or the group itself failing
            raise
        if any(not isinstance(g, RendezvousOk) for g in opened):
            # peers may map this rank's buffers: freeing exported memory that another process still
            # maps is undefined, so every rank closes its mappings before any rank frees
            self._unmap_then_free("the constructor", quiet=True)
            raise_failures(opened, error)

    def _build_symm_mem(self, device_index: int, dtype) -> None:
        """The buffers from torch symmetric memory, mapped by torch's rendezvous on the group (a
        collective of torch's, over the group's store, entered by every rank or by none). cuMem
        keeps a block alive while a peer maps it, so a rank that fails after the rendezvous may
        release its memory at once."""
        group, error, offset, state = self.group, None, None, self._moe_ar_state
        try:
            try:
                state.memory = RankMemory(device_index, self.buffer_elems, dtype.itemsize, buffers=SymmMemBuffers)
            except Exception as e:
                error = e
            exchange_status(group, "allocating the buffers (torch symmetric memory)", error)
            try:
                offset = state.memory.block.rendezvous(group, self.rank, self.world_size)
            except Exception as e:
                error = e
            offsets = exchange_status(group, "mapping the peers' buffers (torch symmetric memory rendezvous)",
                                      error, offset)
            state.peer_buffers = state.memory.block.peer_pointers(offsets) + [0] * (
                registry.program_set().limits["max_world_size"] - self.world_size)
        except BaseException:
            self._release(quiet=True)
            raise

    @staticmethod
    def _group_rank(group) -> tuple[int, int]:
        import torch.distributed as dist
        if group is None:
            raise ValueError("group: a process group is required (pass dist.group.WORLD to mean the default one)")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call dist.init_process_group first)")
        if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("group: this process is not a member of the group")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the group")
        return rank, dist.get_world_size(group)

    def _open_peers(self, handles: list) -> None:
        import cupy
        from cupy.cuda import runtime
        state = self._moe_ar_state
        with cupy.cuda.Device(self.device_index):
            for r, h in enumerate(handles):
                if r == self.rank:
                    state.peer_buffers[r] = state.memory.buffers
                else:
                    ptr = runtime.ipcOpenMemHandle(h, _IPC_LAZY_ENABLE_PEER_ACCESS)
                    self._opened.append(ptr)
                    state.peer_buffers[r] = ptr

    def _close_mappings(self, quiet: bool = False) -> None:
        """Close every mapping of a peer's buffers; the first error is raised at the end unless quiet."""
        import cupy
        from cupy.cuda import runtime
        errors = []
        self._moe_ar_state.peer_buffers = [0] * registry.program_set().limits["max_world_size"]
        with cupy.cuda.Device(self.device_index):
            while self._opened:
                try:
                    runtime.ipcCloseMemHandle(self._opened.pop())
                except Exception as e:
                    errors.append(e)
        if errors and not quiet:
            raise errors[0]

    def _release(self, quiet: bool = False) -> None:
        """Close the peers' mappings and free this rank's memory, with no exchange (nothing of this
        rank is mapped by a peer, or the group cannot exchange any more)."""
        try:
            self._close_mappings(quiet)
        finally:
            if self._moe_ar_state.memory is not None:
                self._moe_ar_state.memory.free(quiet)

    def _unmap_then_free(self, during: str, quiet: bool = False) -> None:
        """Collective: close the mappings of the peers' buffers, and free this rank's memory once every
        rank has closed its own. If a rank could not, the memory stays allocated (freeing it while a
        peer maps it is undefined) and every rank raises RuntimeError naming that rank (unless quiet)."""
        error = rendezvous_attempt(self._close_mappings)
        closed = gather_status(self.group, f"{during}: closing the peers' mappings", error)
        if all(isinstance(g, RendezvousOk) for g in closed):
            self._moe_ar_state.memory.free(quiet)
        elif not quiet:
            raise_failures(closed, error)

    def reset(self) -> None:
        """Collective: bring the group back to a clean state after a timeout."""
        self._moe_ar_state.ensure_open()
        with torch.cuda.device(self.device_index):
            # every rank's kernels have finished before any rank refills its buffers, and every rank
            # has refilled before any returns; a rank that fails makes every rank raise
            exchange_status(self.group, "reset: finishing this rank's kernels",
                            rendezvous_attempt(lambda: torch.cuda.synchronize(self.device)))
            exchange_status(self.group, "reset: refilling the buffers",
                            rendezvous_attempt(self._moe_ar_state.memory.reset))

    def check(self) -> None:
        self._moe_ar_state.ensure_open()
        super().check()

    def close(self) -> None:
        """Collective: release the buffers and the peers' mappings (CUDA IPC: closed, then freed once
        every rank has closed its own; symmetric memory: the tensor and torch's handle dropped once
        every rank has finished its kernels and exchanged once more). If a rank cannot finish its
        kernels, every rank raises and keeps its workspace (a peer may still write into it)."""
        if self._moe_ar_state.closed:
            return
        with torch.cuda.device(self.device_index):
            # no peer may still write into this rank's buffers: every rank's kernels have finished
            exchange_status(self.group, "close: finishing this rank's kernels",
                            rendezvous_attempt(lambda: torch.cuda.synchronize(self.device)))
            self._forget()
            self._unmap_then_free("close")


def check() -> None:
    """Raise RuntimeError naming the rank and phase if any live workspace's kernel timed out, or if
    routes with an index >= allreduce_in.shape[0] were skipped. Synchronizes the devices: call it
    off the hot path (between steps, in tests)."""
    for w in list(_live_workspaces):
        w.check()
