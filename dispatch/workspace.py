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

Rendezvous (Workspace): every rank checks its arguments, then the ranks exchange a RankDescriptor
(arguments, buffer size, program-set hash, host and GPU identity) before anything is allocated, and
every rank compares them identically: a disagreement is the same ValueError on every rank. Each later
fallible local step (allocation, CUDA IPC) ends in an exchange of its status instead of a barrier, so a
rank that fails makes every rank raise at once instead of leaving its peers waiting.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import numbers
import operator
import socket
import weakref
from typing import NamedTuple

import numpy as np
import torch

from . import registry

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
SENTINEL_WORD = 0x80008000  # two -0.0 halves
STATE_WORDS = 8
STATE_BAD_ROWS = 5
ERROR_WORDS = 4
PHASES = {0: "none", 1: "reduce-scatter (waiting for peers' partials)",
          2: "all-gather (waiting for the owners' residual_out rows)", 3: "one-shot (waiting for peers' partials)"}
_CUDA_HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02
_IPC_LAZY_ENABLE_PEER_ACCESS = 0x01

_live_workspaces = weakref.WeakSet()  # every constructed, not yet closed workspace, for dispatch.check()
_ALL_TOKENS = 2**31 - 1
# The largest deadline: the kernel adds timeout_ns to %globaltimer (ns; since 1970 on current drivers,
# about 2^61) in a uint64, which one day (8.64e13 ns) keeps far from 2^64 whatever the timer's origin;
# a wait on a peer longer than a day is a hang in all but name.
MAX_TIMEOUT_S = 86400


def _register(workspace) -> None:
    _live_workspaces.add(workspace)


# ---- arguments ------------------------------------------------------------------------------------

def _int_arg(name: str, value, lo: int, hi: int | None = None, what: str = "") -> int:
    """An int argument (a Python or NumPy integer, never a bool or a float) within lo..hi."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: {value!r} ({type(value).__name__}) is not an int{what}")
    v = operator.index(value)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}: {v} is out of range, expected {lo}..{'' if hi is None else hi}{what}")
    return v


def _timeout_ns(timeout_s) -> int:
    """The deadline in ns; a positive timeout is at least 1 ns (0 means no deadline)."""
    return max(1, round(float(timeout_s) * 1e9)) if timeout_s else 0


def _check_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread) -> None:
    """Every argument check that needs no GPU (and no collective): types, ranges, the manifest's limits.
    ValueError naming the argument."""
    ps = registry.program_set()
    limits = ps.limits
    generated = ps.manifest["axes"]["world_sizes"]
    _int_arg("world_size", world_size, 1)
    if world_size not in generated:
        raise ValueError(f"world_size: {world_size} is not generated (have {generated})")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported (use torch.float16 or torch.bfloat16)")
    _int_arg("max_tokens", max_tokens, 1)
    hidden = _int_arg("hidden", hidden, 16, limits["max_hidden"],
                      f" (a positive multiple of 16, at most {limits['max_hidden']})")
    if hidden % 16:
        raise ValueError(f"hidden: {hidden} is not a multiple of 16")
    if (isinstance(timeout_s, (bool, np.bool_)) or not isinstance(timeout_s, numbers.Real)
            or not math.isfinite(timeout_s) or not 0 <= timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s: {timeout_s!r}, expected a finite number of seconds in 0..{MAX_TIMEOUT_S} "
                         f"(0 disables the deadline)")
    if oneshot_max_tokens is not None:
        _int_arg("oneshot_max_tokens", oneshot_max_tokens, 1, max_tokens, " (1..max_tokens, or None)")
    if vec_per_thread is not None:
        _int_arg("vec_per_thread", vec_per_thread, 1, limits["max_vec_per_thread"], " (or None)")


def _check_devices(devices, world_size) -> list:
    """EmulatedWorld's `devices`: W GPU indices (ints, "cuda:i" or torch.device("cuda", i)); None entries
    stand for the current device (resolved later). Needs no GPU."""
    if devices is None:
        return [None] * world_size
    if isinstance(devices, (str, bytes, torch.device)) or not hasattr(devices, "__len__"):
        raise ValueError(f"devices: expected a list of {world_size} GPU indices, got {type(devices).__name__}")
    devices = list(devices)
    if len(devices) != world_size:
        raise ValueError(f"devices: {len(devices)} entries for world_size {world_size}")
    count = torch.cuda.device_count()
    out = []
    for d in devices:
        if isinstance(d, (str, torch.device)):
            try:
                dev = torch.device(d)
            except (RuntimeError, TypeError, ValueError):
                raise ValueError(f"devices: {d!r} is not a device") from None
            if dev.type != "cuda":
                raise ValueError(f"devices: {d!r} is not a CUDA device")
            out.append(dev.index)
            continue
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, numbers.Integral):
            raise ValueError(f"devices: entry {d!r} ({type(d).__name__}) is not a GPU index")
        out.append(operator.index(d))
    for i in out:
        if i is not None and not 0 <= i < count:
            raise ValueError(f"devices: GPU {i} does not exist ({count} visible)")
    return out


# ---- rendezvous -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RankDescriptor:
    """What every rank of a Workspace must agree on (or, for `gpu`, differ in), exchanged before any
    allocation."""
    world_size: int
    program_set: str      # program_set_sha256()
    dtype: str            # str(torch dtype)
    hidden: int
    max_tokens: int
    oneshot_max_tokens: int
    vec_per_thread: int | None
    timeout_ns: int
    buffer_bytes: int
    host: str             # host_identity()
    gpu: str              # the GPU's UUID


@dataclasses.dataclass(frozen=True)
class _Failure:
    """A rank's local step that raised, as its peers learn of it."""
    step: str
    error_type: str
    message: str
    value_error: bool


@dataclasses.dataclass(frozen=True)
class _Ok:
    payload: object


@functools.lru_cache(maxsize=None)
def program_set_sha256() -> str:
    """sha256 of the verified manifest (it lists every generated file's sha256): ranks with the same
    hash run the same programs, tables and parameter layout. Computed once per process."""
    text = json.dumps(registry.program_set().manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def host_identity() -> str:
    """The host name and, where readable, the kernel's boot id (two machines may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname() + (f" boot {boot}" if boot else "")


def _gpu_identity(device_index: int) -> str:
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}" if not str(uuid).startswith("GPU-") else str(uuid)
    import cupy  # older torch: the PCI bus id is unique within a host
    return f"PCI {cupy.cuda.Device(device_index).pci_bus_id}"


def _gather_status(group, step: str, error: BaseException | None, payload=None) -> list:
    """Collective on `group`: every rank's _Ok(payload) or _Failure, in group rank order."""
    import torch.distributed as dist
    mine = _Ok(payload) if error is None else _Failure(step, type(error).__name__, str(error),
                                                       isinstance(error, ValueError))
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def _raise_failures(gathered: list, error: BaseException | None) -> list:
    """Every rank's payload if no rank failed; else the same exception on every rank: the ValueError of
    a rank whose arguments were bad (its message starts with the argument's name), else RuntimeError
    naming the step, the rank and its error. `error`: this rank's own, chained."""
    failed = [(r, g) for r, g in enumerate(gathered) if not isinstance(g, _Ok)]
    if not failed:
        return [g.payload for g in gathered]
    r, f = next(((r, f) for r, f in failed if f.value_error), failed[0])
    others = [str(q) for q, _ in failed if q != r]
    also = f"; rank{'s' if len(others) > 1 else ''} {', '.join(others)} failed too" if others else ""
    W = len(gathered)
    if f.value_error:
        raise ValueError(f"{f.message} (rank {r} of {W}{also})") from error
    raise RuntimeError(f"workspace: {f.step} failed on rank {r} of {W}: {f.error_type}: {f.message}{also}") \
        from error


def exchange_status(group, step: str, error: BaseException | None = None, payload=None) -> list:
    """Collective on `group`: every rank reports whether its local `step` succeeded (with `payload`)
    or raised `error`. Returns every rank's payload, in group rank order, when all succeeded; otherwise
    raises on every rank alike (see _raise_failures)."""
    return _raise_failures(_gather_status(group, step, error, payload), error)


def _show(field: str, value) -> str:
    if field == "timeout_ns":
        return "0 (no deadline)" if value == 0 else f"{value / 1e9:g} s"
    if field == "vec_per_thread" and value is None:
        return "None (chosen per call)"
    if field == "program_set":
        return f"programs with manifest sha256 {value[:16]}..."
    return str(value)


_FIELD_ARGUMENT = {"timeout_ns": "timeout_s"}
_SAME = ("world_size", "host", "program_set", "dtype", "hidden", "max_tokens", "oneshot_max_tokens", "vec_per_thread",
         "timeout_ns", "buffer_bytes")


def compare_descriptors(descriptors: list) -> None:
    """Raise ValueError naming the first field in which a rank differs from rank 0 (world size, host,
    programs, arguments, buffer size), or two ranks that share a GPU. Every rank calls it on the same
    list and so raises the same error."""
    d0 = descriptors[0]
    for field in _SAME:
        for r, d in enumerate(descriptors):
            if field == "host" and d.host != d0.host:
                raise ValueError(f"host: rank {r} is on {d.host}, rank 0 on {d0.host}; the CUDA IPC backend "
                                 f"works within one host only: run every rank of the group on one machine")
            if getattr(d, field) != getattr(d0, field):
                name = _FIELD_ARGUMENT.get(field, field)
                raise ValueError(f"{name}: rank {r} has {_show(field, getattr(d, field))}, rank 0 has "
                                 f"{_show(field, getattr(d0, field))}; every rank of the group must have the same")
    seen = {}
    for r, d in enumerate(descriptors):
        if d.gpu in seen:
            raise ValueError(f"device: ranks {seen[d.gpu]} and {r} are on the same GPU {d.gpu}; one process per "
                             f"GPU (use EmulatedWorld to run several ranks on one GPU)")
        seen[d.gpu] = r


def rendezvous(group, descriptor: RankDescriptor | None, error: BaseException | None = None) -> list:
    """Collective on `group` (never the default group in its place): every rank's descriptor, after
    checking that they agree. `error`: this rank's local checks failed (its descriptor is None); every
    rank raises. Raises the same ValueError on every rank for a disagreement."""
    descriptors = exchange_status(group, "checking the arguments", error, descriptor)
    compare_descriptors(descriptors)
    return descriptors


def _attempt(fn) -> BaseException | None:
    """Run a fallible local step; its exception, to be exchanged, or None."""
    try:
        fn()
    except Exception as e:
        return e
    return None


class RowSplit(NamedTuple):
    """Calls of up to `max_tokens` tokens spread a row over `threads` threads (a block), each
    holding up to `vec_per_thread` 16-byte vectors."""
    max_tokens: int
    threads: int
    vec_per_thread: int


def _split(nvec: int, vec_per_thread: int, max_tokens: int) -> RowSplit:
    threads = 32 * -(-nvec // (32 * vec_per_thread))  # whole warps
    return RowSplit(max_tokens, threads, -(-nvec // threads))


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
        self.buffers = self.state = self.error_host = 0
        try:
            with cupy.cuda.Device(device_index):
                self.buffers = runtime.malloc(self.buffer_bytes)
                self.state = runtime.malloc(STATE_WORDS * 4)
            self.error_host = runtime.hostAlloc(ERROR_WORDS * 4, _CUDA_HOST_ALLOC_PORTABLE_MAPPED)
            # With unified addressing a mapped host allocation has the same address on the device.
            self.error = np.ctypeslib.as_array((ctypes.c_uint32 * ERROR_WORDS).from_address(self.error_host))
            self.reset()
        except BaseException:
            self.free(quiet=True)  # what was taken before the step that failed
            raise

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

    def free(self, quiet: bool = False) -> None:
        """Release what is allocated, each part on its own (also after a failed constructor); the
        first error is raised at the end unless `quiet` (cleanup while another error is raised)."""
        import cupy
        from cupy.cuda import runtime
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception as e:
                errors.append(e)

        if self.buffers or self.state:
            try:
                with cupy.cuda.Device(self.device_index):
                    attempt(runtime.deviceSynchronize)  # no kernel may still use the buffers
                    for name in ("buffers", "state"):
                        ptr = getattr(self, name)
                        setattr(self, name, 0)  # never freed twice, even if this free fails
                        if ptr:
                            attempt(runtime.free, ptr)
            except Exception as e:
                errors.append(e)
        if self.error_host:
            ptr, self.error_host = self.error_host, 0
            attempt(runtime.freeHost, ptr)
        if errors and not quiet:
            raise errors[0]


class _WorkspaceBase:
    """What a call needs from a rank's workspace; see Workspace and EmulatedWorld."""

    rank: int
    world_size: int

    def _init_common(self, world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                     oneshot_max_tokens, ranks_on_device, vec_per_thread=None):
        _check_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
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
        self.timeout_ns = _timeout_ns(timeout_s)
        self.oneshot_max_tokens = min(max_tokens, 1024) if oneshot_max_tokens is None else int(oneshot_max_tokens)
        self.vec_per_thread = vec_per_thread
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
            self.row_splits = (_split(nvec, vec_per_thread, _ALL_TOKENS),)
        if self.row_splits[-1].threads > limits["max_threads"]:
            raise ValueError(f"vec_per_thread: {vec_per_thread} vectors a thread needs {self.row_splits[-1].threads} "
                             f"threads for hidden {hidden}, more than {limits['max_threads']}")
        self._launchers = {}
        self._plans = {}  # call signature -> op._Plan
        self._closed = False
        # Fault injection for tests only: > 0 makes this rank's kernels send that many phase-1 work
        # units and stop (tests/test_gpu_reliability.py). Never set it in real use.
        self._fault_stop_after_units = 0

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
        if state[STATE_BAD_ROWS]:
            raise RuntimeError(f"moe_finalize_allreduce: rank {self.rank}: routes had an expanded_idx_to_permuted_idx "
                               f"entry >= allreduce_in.shape[0]; they were skipped ({int(state[STATE_BAD_ROWS])} "
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
    is used for every exchange and never the default group in its place.

    Arguments: `max_tokens` (T of the largest call), `hidden` (H: a multiple of 16, at most 16384),
    `dtype` (torch.float16 or torch.bfloat16), `timeout_s` (deadline of any wait on a peer, 0..86400;
    0 disables it), `oneshot_max_tokens` (one-shot buffer capacity, 1..max_tokens, default
    min(max_tokens, 1024)), `vec_per_thread` (16-byte vectors of a row per thread, 1..4, for every
    call; default None: per call, 2 up to the manifest's few_tokens_max (256) tokens and 4 above).

    Before allocating anything the ranks exchange a RankDescriptor: every rank must pass the same
    arguments and have the same buffer size, programs (manifest hash), world size and host, each on
    its own GPU. Any difference, and a bad argument on any rank, is the same ValueError on every rank,
    naming the field or argument. A rank whose allocation or CUDA IPC step fails makes every rank
    raise RuntimeError naming the step and the rank; every rank frees what it took. After close(),
    a call with this workspace raises ValueError.
    """

    def __init__(self, group, max_tokens: int, hidden: int, dtype: torch.dtype, *, timeout_s: float = 10.0,
                 oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None):
        import cupy
        from cupy.cuda import runtime
        rank, world_size = self._group_rank(group)
        self.group = group
        self._memory = None
        self._opened = []
        self._peer_buffers = [0] * registry.program_set().limits["max_world_size"]
        # 1. Local checks (no allocation), then the descriptors: a bad argument or a disagreement on
        #    any rank is the same error on every rank, before anything is allocated.
        descriptor, error = None, None
        try:
            _check_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
            device_index = torch.cuda.current_device()
            self._init_common(world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                              oneshot_max_tokens, ranks_on_device=1, vec_per_thread=vec_per_thread)
            descriptor = RankDescriptor(
                world_size=world_size, program_set=program_set_sha256(), dtype=str(dtype), hidden=self.hidden,
                max_tokens=self.max_tokens, oneshot_max_tokens=self.oneshot_max_tokens,
                vec_per_thread=self.vec_per_thread, timeout_ns=self.timeout_ns,
                buffer_bytes=3 * self.buffer_elems * dtype.itemsize, host=host_identity(),
                gpu=_gpu_identity(device_index))
        except Exception as e:
            error = e
        self._closed = True  # until every rank has built it
        rendezvous(group, descriptor, error)
        # 2. Allocation, 3. the peers' buffers: each step ends in an exchange of its status instead of
        #    a barrier, so one rank's failure reaches every rank at once; each frees what it took.
        try:
            handle = None
            try:
                self._memory = _RankMemory(device_index, self.buffer_elems, dtype.itemsize)
                with cupy.cuda.Device(device_index):
                    handle = bytes(runtime.ipcGetMemHandle(self._memory.buffers))
            except Exception as e:
                error = e
            handles = exchange_status(group, "allocating the buffers", error, handle)  # nothing mapped yet
            error = _attempt(lambda: self._open_peers(handles))
            opened = _gather_status(group, "opening the peers' buffers over CUDA IPC", error)
        except BaseException:
            self._release(quiet=True)  # a failed allocation, or the group itself failing
            raise
        if any(not isinstance(g, _Ok) for g in opened):
            # peers may map this rank's buffers: freeing exported memory that another process still
            # maps is undefined, so every rank closes its mappings before any rank frees
            self._unmap_then_free("the constructor", quiet=True)
            _raise_failures(opened, error)
        self._closed = False
        _register(self)

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
        with cupy.cuda.Device(self.device_index):
            for r, h in enumerate(handles):
                if r == self.rank:
                    self._peer_buffers[r] = self._memory.buffers
                else:
                    ptr = runtime.ipcOpenMemHandle(h, _IPC_LAZY_ENABLE_PEER_ACCESS)
                    self._opened.append(ptr)
                    self._peer_buffers[r] = ptr

    def _close_mappings(self, quiet: bool = False) -> None:
        """Close every mapping of a peer's buffers; the first error is raised at the end unless quiet."""
        import cupy
        from cupy.cuda import runtime
        errors = []
        self._peer_buffers = [0] * registry.program_set().limits["max_world_size"]
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
            if self._memory is not None:
                self._memory.free(quiet)

    def _unmap_then_free(self, during: str, quiet: bool = False) -> None:
        """Collective: close the mappings of the peers' buffers, and free this rank's memory once every
        rank has closed its own. If a rank could not, the memory stays allocated (freeing it while a
        peer maps it is undefined) and every rank raises RuntimeError naming that rank (unless quiet)."""
        error = _attempt(self._close_mappings)
        closed = _gather_status(self.group, f"{during}: closing the peers' mappings", error)
        if all(isinstance(g, _Ok) for g in closed):
            self._memory.free(quiet)
        elif not quiet:
            _raise_failures(closed, error)

    def reset(self) -> None:
        """Collective: bring the group back to a clean state after a timeout."""
        self._ensure_open()
        with torch.cuda.device(self.device_index):
            # every rank's kernels have finished before any rank refills its buffers, and every rank
            # has refilled before any returns; a rank that fails makes every rank raise
            exchange_status(self.group, "reset: finishing this rank's kernels",
                            _attempt(lambda: torch.cuda.synchronize(self.device)))
            exchange_status(self.group, "reset: refilling the buffers", _attempt(self._memory.reset))

    def check(self) -> None:
        self._ensure_open()
        super().check()

    def close(self) -> None:
        """Collective: release the buffers and the peers' IPC mappings. If a rank cannot finish its
        kernels, every rank raises and keeps its workspace (a peer may still write into it)."""
        if self._closed:
            return
        with torch.cuda.device(self.device_index):
            # no peer may still write into this rank's buffers: every rank's kernels have finished
            exchange_status(self.group, "close: finishing this rank's kernels",
                            _attempt(lambda: torch.cuda.synchronize(self.device)))
            self._closed = True
            self._launchers.clear()
            self._plans.clear()
            _live_workspaces.discard(self)
            self._unmap_then_free("close")


class _EmulatedRank(_WorkspaceBase):
    def __init__(self, world, rank, device_index, ranks_on_device):
        self._init_common(world.world_size, rank, world.max_tokens, world.hidden, world.dtype, device_index,
                          world.timeout_s, world.oneshot_max_tokens, ranks_on_device, world.vec_per_thread)
        self._memory = _RankMemory(device_index, self.buffer_elems, world.dtype.itemsize)
        self._peer_buffers = [0] * registry.program_set().limits["max_world_size"]
        self.world = world

    def check(self) -> None:
        self._ensure_open()
        super().check()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._launchers.clear()
            self._plans.clear()
            _live_workspaces.discard(self)
            self._memory.free()


class EmulatedWorld:
    """All ranks of a world in this process: each rank its own buffers and stream.

    `devices` gives each rank's GPU (default: all on the current one); GPUs must reach each other
    directly (peer access is enabled here). Kernels of all ranks are launched on per-rank streams
    and sized so that every rank's grid is resident at once. Other arguments as for Workspace.
    Raises ValueError for a `devices` list of the wrong length, an entry that is not a visible GPU or
    GPUs without peer access, and as Workspace for the rest, before any allocation. If a rank's
    allocation fails, every rank's memory is freed and RuntimeError names the rank. Proves
    correctness of world sizes 4 and 8 without 4 or 8 GPUs; its timings say nothing about a real machine.
    """

    def __init__(self, world_size: int, max_tokens: int, hidden: int, dtype: torch.dtype, *, devices=None,
                 timeout_s: float = 10.0, oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None):
        import cupy
        from cupy.cuda import runtime
        _check_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
        world_size = int(world_size)
        devices = _check_devices(devices, world_size)  # before any CUDA call
        if None in devices:
            current = torch.cuda.current_device()
            devices = [current if d is None else d for d in devices]
        self.world_size, self.max_tokens, self.hidden, self.dtype = world_size, int(max_tokens), int(hidden), dtype
        self.timeout_s, self.oneshot_max_tokens = timeout_s, oneshot_max_tokens
        self.vec_per_thread = vec_per_thread
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
            ptrs = [w._memory.buffers for w in self.workspaces]
            for w in self.workspaces:
                w._peer_buffers = ptrs + [0] * (registry.program_set().limits["max_world_size"] - world_size)
            self.streams = [torch.cuda.Stream(device=d) for d in devices]
        except Exception as e:
            for w in self.workspaces:  # every rank built so far
                w._memory.free(quiet=True)
                w._closed = True
            self.workspaces = []
            if isinstance(e, ValueError):
                raise
            raise RuntimeError(f"EmulatedWorld: allocating {what} failed ({type(e).__name__}: {e}); every "
                               f"rank's memory was freed") from e
        for w in self.workspaces:
            _register(w)

    def _ensure_open(self) -> None:
        if any(w._closed for w in self.workspaces):
            raise ValueError("workspace: this world was closed")

    def run(self, per_rank_kwargs: list[dict]) -> list:
        """One call on every rank: `per_rank_kwargs[r]` holds rank r's keyword arguments of
        moe_finalize_allreduce (without the workspace). Every rank's call is checked before any is
        launched (ValueError naming the argument); the kernels run co-resident on per-rank streams,
        joined back to each device's current stream. Returns the list of MoeFinalizeOutputs.
        Capturable in a CUDA graph (single-device worlds)."""
        from .op import check_rank_overlaps, prepare_call
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
            w._memory.reset()

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


def check() -> None:
    """Raise RuntimeError naming the rank and phase if any live workspace's kernel timed out, or if
    routes with an index >= allreduce_in.shape[0] were skipped. Synchronizes the devices: call it
    off the hot path (between steps, in tests)."""
    for w in list(_live_workspaces):
        w.check()
