"""Workspaces: each rank's Lamport buffers, device state and error words, and its peers' buffers.

    Workspace(group, max_tokens, hidden, dtype)       one process per GPU; peers over CUDA IPC
    Workspace(..., backend="symm_mem")                the buffers from torch symmetric memory instead
                                                      ("auto": where every rank can, else CUDA IPC)
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
(arguments, backend, buffer size, program-set hash, host and GPU identity, whether torch symmetric
memory is usable, the GPU's NVLink domain) before anything is allocated, and every rank compares them
identically: a disagreement is the same ValueError on every rank, and every rank chooses the same
backend. Each later fallible local step (allocation, CUDA IPC or torch's rendezvous) ends in an
exchange of its status instead of a barrier, so a rank that fails makes every rank raise at once
instead of leaving its peers waiting.

Backends (only the buffers differ; the state and error words are local and allocated alike, and the
kernels see one pointer per rank either way, so the same generated programs run on both):

    ipc        cudaMalloc, CUDA IPC handles exchanged on the group: one host only
    symm_mem   torch.distributed._symmetric_memory (its CUDA backend, cuMem allocations) mapped by
               torch's rendezvous on the group: one host, or hosts of one multi-node NVLink domain.
               NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless the caller set it)
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import numbers
import operator
import os
import socket
import warnings
import weakref
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
BACKENDS = ("ipc", "symm_mem", "auto")
# Torch's CUDA symmetric memory builds an NVLink multicast object at rendezvous unless this is set;
# our kernels use none, and multicast can take a shared host's GPUs down.
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
# CUdevice_attribute values (cuda.h)
_CU_ATTR_VIRTUAL_MEMORY_MANAGEMENT = 102
_CU_ATTR_HANDLE_TYPE_POSIX_FD = 103
_CU_ATTR_HANDLE_TYPE_FABRIC = 128
_NVML_FABRIC_STATE_COMPLETED = 3

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


def _check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected 'ipc', 'symm_mem' or 'auto'")
    return backend


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
    backend: str = "ipc"  # the backend asked for: ipc, symm_mem or auto
    symm_mem_unavailable: str = ""  # why this rank cannot use torch symmetric memory; "" when it can
    nvlink_domain: str = ""         # this GPU's NVLink domain where the driver proves one (nvlink_domain())
    nvlink_note: str = ""           # why no domain is proven


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


# ---- backend facts (local, no collective: every rank computes its own and the descriptors carry them) ----

def _symm_mem_module():
    """torch.distributed._symmetric_memory (behind a function so that tests can replace it)."""
    import torch.distributed._symmetric_memory as symm
    return symm


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _cu_device_attribute(device_index: int, attribute: int) -> int:
    """cuDeviceGetAttribute through the CUDA driver library (loaded by torch and CuPy already)."""
    lib = _libcuda()
    dev, value = ctypes.c_int(), ctypes.c_int()
    steps = (("cuInit", lambda: lib.cuInit(0)),
             ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), int(device_index))),
             ("cuDeviceGetAttribute", lambda: lib.cuDeviceGetAttribute(ctypes.byref(value), int(attribute), dev)))
    for what, call in steps:
        code = call()
        if code:
            raise RuntimeError(f"{what} returned CUDA driver error {code}")
    return value.value


def symm_mem_unavailable(group, device_index: int) -> str:
    """Why this rank cannot build its buffers on torch symmetric memory for `group`, or "" when it can.
    Cheap and local (no collective, no allocation): the import, the API, torch's backend for the
    device (its CUDA backend: cuMem allocations, which this workspace relies on) and the GPU's support
    for cuMem and for exporting memory."""
    version = torch.__version__
    try:
        symm = _symm_mem_module()
    except Exception as e:
        return f"torch {version} cannot import torch.distributed._symmetric_memory ({type(e).__name__}: {e})"
    try:
        p2p = getattr(getattr(symm, "_SymmetricMemory", None), "empty_strided_p2p", None)
        rendezvous_fn = getattr(symm, "rendezvous", None)
        if p2p is None or rendezvous_fn is None or not hasattr(symm, "get_backend"):
            return f"torch {version}'s symmetric memory lacks empty_strided_p2p, rendezvous or get_backend"
        if "group" not in inspect.signature(rendezvous_fn).parameters:
            return f"torch {version}'s symmetric memory has no rendezvous(tensor, group)"
        name = getattr(group, "group_name", None)
        if not isinstance(name, str) or not name:
            return "the group has no group_name, which torch's rendezvous needs"
        backend = symm.get_backend(torch.device("cuda", device_index))
        if backend is None:
            return f"torch {version} has no symmetric-memory allocator for CUDA devices"
        if backend != "CUDA":
            return (f"torch's symmetric-memory backend for cuda:{device_index} is {backend!r}; this workspace uses "
                    f"its 'CUDA' backend only (an NVSHMEM allocation is collective over every process of the job, "
                    f"not only the group): set TORCH_SYMMMEM=CUDA")
        if not _cu_device_attribute(device_index, _CU_ATTR_VIRTUAL_MEMORY_MANAGEMENT):
            return f"GPU {device_index} does not support CUDA virtual memory management (cuMemCreate)"
        if not (_cu_device_attribute(device_index, _CU_ATTR_HANDLE_TYPE_POSIX_FD)
                or _cu_device_attribute(device_index, _CU_ATTR_HANDLE_TYPE_FABRIC)):
            return f"GPU {device_index} exports memory neither as a POSIX file descriptor nor as a fabric handle"
    except Exception as e:
        return f"checking torch symmetric memory failed ({type(e).__name__}: {e})"
    return ""


class _NvmlFabricInfoV2(ctypes.Structure):  # nvmlGpuFabricInfo_v2_t
    _fields_ = [("version", ctypes.c_uint), ("cluster_uuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int),
                ("clique_id", ctypes.c_uint), ("state", ctypes.c_ubyte), ("health_mask", ctypes.c_uint)]


class _NvmlFabricInfo(ctypes.Structure):  # nvmlGpuFabricInfo_t (drivers without the versioned call)
    _fields_ = [("cluster_uuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int), ("clique_id", ctypes.c_uint),
                ("state", ctypes.c_ubyte)]


def _nvml_fabric(gpu: str) -> tuple:
    """(cluster UUID bytes, clique id, state, status) of the GPU's NVLink fabric registration, from NVML:
    libnvidia-ml.so.1 of the driver, loaded with ctypes as torch.cuda loads it (no Python package)."""
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    code = lib.nvmlInit_v2()
    if code:
        raise RuntimeError(f"nvmlInit_v2 returned {code}")
    try:
        handle = ctypes.c_void_p()
        if gpu.startswith("GPU-"):
            code = lib.nvmlDeviceGetHandleByUUID(gpu.encode(), ctypes.byref(handle))
        elif gpu.startswith("PCI "):
            code = lib.nvmlDeviceGetHandleByPciBusId_v2(gpu[4:].encode(), ctypes.byref(handle))
        else:
            raise RuntimeError(f"no NVML device for {gpu!r}")
        if code:
            raise RuntimeError(f"NVML found no device {gpu} (error {code})")
        if hasattr(lib, "nvmlDeviceGetGpuFabricInfoV"):
            info = _NvmlFabricInfoV2(version=ctypes.sizeof(_NvmlFabricInfoV2) | (2 << 24))
            code = lib.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        else:
            info = _NvmlFabricInfo()
            code = lib.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        if code:
            raise RuntimeError(f"nvmlDeviceGetGpuFabricInfo returned {code}")
        return bytes(info.cluster_uuid), int(info.clique_id), int(info.state), int(info.status)
    finally:
        lib.nvmlShutdown()


_proven_domains: dict = {}


def nvlink_domain(device_index: int, gpu: str) -> tuple[str, str]:
    """(domain, note): this GPU's NVLink domain, "fabric cluster <uuid> clique <id>", where the driver
    proves one (the GPU exports fabric handles and its NVLink fabric registration completed), else
    ("", why not). Ranks on different hosts share a workspace only with the same non-empty domain.
    A proven domain is remembered per GPU; a failure is read again next time."""
    if gpu in _proven_domains:
        return _proven_domains[gpu], ""
    try:
        if not _cu_device_attribute(device_index, _CU_ATTR_HANDLE_TYPE_FABRIC):
            return "", "its GPU does not export fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0)"
        uuid, clique, state, status = _nvml_fabric(gpu)
    except Exception as e:
        return "", f"its GPU's NVLink fabric could not be read ({type(e).__name__}: {e})"
    if state != _NVML_FABRIC_STATE_COMPLETED:
        return "", f"its GPU's NVLink fabric registration is not complete (NVML fabric state {state})"
    if status != 0:
        return "", f"NVML reports NVLink fabric status {status} for its GPU"
    if not any(uuid):
        return "", "NVML reports no NVLink fabric cluster for its GPU"
    _proven_domains[gpu] = f"fabric cluster {uuid.hex()} clique {clique}"
    return _proven_domains[gpu], ""


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
_SAME = ("world_size", "backend", "program_set", "dtype", "hidden", "max_tokens", "oneshot_max_tokens",
         "vec_per_thread", "timeout_ns", "buffer_bytes")


def choose_backend(descriptors: list) -> tuple[str, str]:
    """(backend, why) from the ranks' descriptors (which agree on the backend asked for): "ipc" when
    asked; "symm_mem" when asked or on "auto" if torch symmetric memory is usable on every rank; on
    "auto" otherwise "ipc". Raises ValueError naming `backend` when "symm_mem" is asked for and a rank
    cannot use it. Every rank calls it on the same list and so gets the same answer or error."""
    asked = descriptors[0].backend
    if asked == "ipc":
        return "ipc", "backend 'ipc' was asked for"
    missing = [(r, d.symm_mem_unavailable) for r, d in enumerate(descriptors) if d.symm_mem_unavailable]
    if not missing:
        return "symm_mem", f"backend {asked!r}: torch symmetric memory is usable on every rank"
    r, why = missing[0]
    others = [str(q) for q, _ in missing[1:]]
    also = f"; not on rank{'s' if len(others) > 1 else ''} {', '.join(others)} either" if others else ""
    if asked == "symm_mem":
        raise ValueError(f"backend: 'symm_mem' is not available on rank {r}: {why}{also} (use backend='ipc', or "
                         f"'auto' to fall back to it)")
    return "ipc", f"backend 'auto' chose 'ipc': torch symmetric memory is not usable on rank {r}: {why}{also}"


def _check_hosts(descriptors: list, backend: str, why: str) -> None:
    """Ranks on more than one host: refused with CUDA IPC (handles mean nothing on another host), and
    with symmetric memory unless every rank's GPU is proven to be in one NVLink domain."""
    d0 = descriptors[0]
    other = next((r for r, d in enumerate(descriptors) if d.host != d0.host), None)
    if other is None:
        return
    d = descriptors[other]
    if backend == "ipc":
        chosen = f" ({why})" if d0.backend == "auto" else ""
        raise ValueError(f"host: rank {other} is on {d.host}, rank 0 on {d0.host}; the CUDA IPC backend works within "
                         f"one host only{chosen}: run every rank of the group on one machine, or use "
                         f"backend='symm_mem' where the hosts share a multi-node NVLink domain")
    hosts = len({x.host for x in descriptors})
    where = f"its ranks span {hosts} hosts (rank 0 on {d0.host}, rank {other} on {d.host})"
    unproven = [(r, x.nvlink_note or "no NVLink domain is known for its GPU")
                for r, x in enumerate(descriptors) if not x.nvlink_domain]
    if unproven:
        r, note = unproven[0]
        raise ValueError(f"group: {where} and no common NVLink domain is proven: rank {r}: {note}. A workspace "
                         f"across hosts needs every GPU of the group in one multi-node NVLink domain "
                         f"(docs/nvlink-domains.md); otherwise run every rank of the group on one host")
    for r, x in enumerate(descriptors):
        if x.nvlink_domain != d0.nvlink_domain:
            raise ValueError(f"group: {where} in different NVLink domains: rank {r} is in {x.nvlink_domain}, rank 0 "
                             f"in {d0.nvlink_domain}; a peer's memory can be mapped only within one NVLink domain")


def compare_descriptors(descriptors: list) -> tuple[str, str]:
    """Raise ValueError naming the first field in which a rank differs from rank 0 (world size, the
    backend asked for, programs, arguments, buffer size), `backend` when "symm_mem" is asked for and a
    rank cannot use it, a group spanning hosts that the chosen backend cannot span (`host` with CUDA
    IPC, `group` with symmetric memory), or two ranks that share a GPU. Every rank calls it on the same
    list and so raises the same error. Returns choose_backend()'s (backend, why)."""
    d0 = descriptors[0]
    for field in _SAME:
        for r, d in enumerate(descriptors):
            if getattr(d, field) != getattr(d0, field):
                name = _FIELD_ARGUMENT.get(field, field)
                raise ValueError(f"{name}: rank {r} has {_show(field, getattr(d, field))}, rank 0 has "
                                 f"{_show(field, getattr(d0, field))}; every rank of the group must have the same")
    backend, why = choose_backend(descriptors)
    _check_hosts(descriptors, backend, why)
    seen = {}
    for r, d in enumerate(descriptors):
        key = (d.host, d.gpu)  # a PCI bus id (older torch's identity) is unique within a host only
        if key in seen:
            raise ValueError(f"device: ranks {seen[key]} and {r} are on the same GPU {d.gpu}; one process per "
                             f"GPU (use EmulatedWorld to run several ranks on one GPU)")
        seen[key] = r
    return backend, why


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


# What the kernel's 32-bit counts hold (kernels/): T times small factors
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
    """Elements of one rotating buffer: the larger of the one-shot and two-shot layouts (none at world
    size 1, which exchanges nothing)."""
    if world_size == 1:
        return 0
    oneshot = world_size * oneshot_max_tokens * hidden
    per_owner = -(-max_tokens // world_size)
    twoshot = world_size * per_owner * hidden + max_tokens * hidden
    return max(oneshot, twoshot)


class _CudaMallocBuffers:
    """Buffers from cudaMalloc: the CUDA IPC backend exports them; EmulatedWorld's ranks share them
    within the process. Called with the device current."""

    def __init__(self, device_index: int, nbytes: int):
        from cupy.cuda import runtime
        self.ptr = runtime.malloc(nbytes)

    def release(self) -> None:
        from cupy.cuda import runtime
        ptr, self.ptr = self.ptr, 0  # never freed twice, even if this free fails
        if ptr:
            runtime.free(ptr)


class _SymmMemBuffers:
    """Buffers from torch symmetric memory (its CUDA backend): a block of torch's symmetric allocator
    of its own, not one of its implicit pool, which would keep the block past close() and hand it
    back with the peers' mappings torch cached for it (ranks whose pools returned different blocks
    would pair mappings that do not match). rendezvous() maps every peer's block. NVLink multicast
    stays off: MULTICAST_ENV is set to "1" before the allocation unless the caller set it."""

    def __init__(self, device_index: int, nbytes: int):
        os.environ.setdefault(MULTICAST_ENV, "1")
        self.symm = _symm_mem_module()
        self.nbytes = nbytes
        self.handle = None
        self.ptrs = []
        self.tensor = self.symm._SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8,
                                                                   torch.device("cuda", device_index))
        self.ptr = self.tensor.data_ptr()
        if self.ptr % 16:  # the kernels store 16-byte vectors; every rank's block has the same layout
            raise RuntimeError(f"torch's symmetric buffer at {self.ptr:#x} is not 16-byte aligned")

    def rendezvous(self, group, rank: int, world_size: int) -> int:
        """torch's rendezvous on `group` (collective: torch exchanges and maps every rank's block).
        Returns this rank's buffers' offset in its block, which every peer adds to its pointer to the
        block. Raises if a peer's block has no pointer here (a peer torch could not map)."""
        handle = self.symm.rendezvous(self.tensor, group)
        if handle is None:
            raise RuntimeError("torch's rendezvous returned no handle (the buffers are not torch symmetric memory)")
        self.handle = handle
        ptrs = [int(p or 0) for p in handle.buffer_ptrs]
        if len(ptrs) != world_size or getattr(handle, "rank", rank) != rank:
            raise RuntimeError(f"torch's rendezvous gave rank {getattr(handle, 'rank', '?')} of {len(ptrs)}, expected "
                               f"rank {rank} of {world_size}")
        missing = [str(r) for r, p in enumerate(ptrs) if not p]
        if missing:
            raise RuntimeError(f"torch's rendezvous mapped no buffers of rank {', '.join(missing)} (a peer reachable "
                               f"only over the network?)")
        offset = self.ptr - ptrs[rank]
        size = getattr(handle, "buffer_size", None)
        if offset < 0 or (size is not None and offset + self.nbytes > size):
            raise RuntimeError(f"the buffers (at offset {offset}, {self.nbytes} bytes) are not inside torch's block "
                               f"of {size} bytes")
        self.ptrs = ptrs
        return offset

    def peer_pointers(self, offsets: list) -> list:
        """Every rank's buffers in this process's address space, from every rank's offset."""
        return [p + o for p, o in zip(self.ptrs, offsets)]

    def release(self) -> None:
        """Drop the handle and the tensor. Torch then unmaps the peers' blocks and unmaps and releases
        this rank's (cuMemUnmap / cuMemRelease, after synchronizing the device); the driver returns a
        block's memory once every rank that mapped it has released it too."""
        self.handle = None
        self.ptrs = []
        self.tensor = None
        self.ptr = 0


class _RankMemory:
    """One rank's buffers, state and error words, on one device. `buffers`: what allocates the
    buffers (_CudaMallocBuffers or _SymmMemBuffers); the state and error words are the same for every
    backend (local: no peer touches them)."""

    def __init__(self, device_index: int, buffer_elems: int, elem_size: int, buffers=_CudaMallocBuffers):
        import cupy
        from cupy.cuda import runtime
        self.device_index = device_index
        self.buffer_bytes = 3 * buffer_elems * elem_size
        self.block = None
        self.buffers = self.state = self.error_host = 0
        try:
            with cupy.cuda.Device(device_index):
                self.block = buffers(device_index, self.buffer_bytes)
                self.buffers = self.block.ptr
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

        if self.block is not None or self.state:
            try:
                with cupy.cuda.Device(self.device_index):
                    attempt(runtime.deviceSynchronize)  # no kernel may still use the buffers
                    block, self.block, self.buffers = self.block, None, 0  # never released twice
                    if block is not None:
                        attempt(block.release)
                    ptr, self.state = self.state, 0
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
        # default: the largest one-shot boundary of the tables, so no automatic call loses its one-shot
        # and no memory is held for one-shot calls only a forced program= would make; none at world
        # size 1 (nothing is exchanged)
        if oneshot_max_tokens is not None:
            self.oneshot_max_tokens = int(oneshot_max_tokens)
        else:
            self.oneshot_max_tokens = 0 if world_size == 1 else min(max_tokens, registry.oneshot_boundary(world_size))
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
        self._recent_plans = []  # op.prepare_call's most recently used plans, first the last call's
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
    """One rank of a real process group (one process per GPU); peers' buffers over CUDA IPC or torch
    symmetric memory (`backend`).

    Collective: every rank of `group` constructs it together, on its current CUDA device. `group`
    is used for every exchange and never the default group in its place.

    Arguments: `max_tokens` (T of the largest call), `hidden` (H: a multiple of 16, at most 16384),
    `dtype` (torch.float16 or torch.bfloat16), `timeout_s` (deadline of any wait on a peer, 0..86400;
    0 disables it), `oneshot_max_tokens` (one-shot buffer capacity, 1..max_tokens, default
    min(max_tokens, B): B the largest one-shot boundary of the selection tables for the world size,
    dispatch.registry.oneshot_boundary(W); a forced one-shot program= above it needs it larger),
    `vec_per_thread` (16-byte vectors of a row per thread, 1..4, for every call; default None: per
    call, 2 up to the manifest's few_tokens_max (256) tokens and 4 above),
    `backend` ("ipc", the default: cudaMalloc and CUDA IPC, one host; "symm_mem": torch symmetric
    memory, one host or one multi-node NVLink domain; "auto": "symm_mem" where every rank can use
    it, else "ipc" with a RuntimeWarning saying why). `backend` and `backend_reason` hold the choice.

    Before allocating anything the ranks exchange a RankDescriptor: every rank must pass the same
    arguments and have the same buffer size, programs (manifest hash) and world size, each on its own
    GPU, on hosts the chosen backend can span. Any difference, and a bad argument on any rank, is the
    same ValueError on every rank, naming the field or argument. A rank whose allocation, CUDA IPC
    step or torch rendezvous fails makes every rank raise RuntimeError naming the step and the rank;
    every rank frees what it took. After close(), a call with this workspace raises ValueError.
    """

    def __init__(self, group, max_tokens: int, hidden: int, dtype: torch.dtype, *, timeout_s: float = 10.0,
                 oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None, backend: str = "ipc"):
        rank, world_size = self._group_rank(group)
        self.group = group
        self._memory = None
        self._opened = []
        self._peer_buffers = [0] * registry.program_set().limits["max_world_size"]
        self.backend = self.backend_reason = None
        if world_size == 1:  # nothing to exchange: LocalWorkspace's memory, no buffers, no rendezvous
            from .local import LocalMemory
            _check_backend(backend)
            self._init_common(1, 0, max_tokens, hidden, dtype, torch.cuda.current_device(), timeout_s,
                              oneshot_max_tokens, ranks_on_device=1, vec_per_thread=vec_per_thread)
            self.backend, self.backend_reason = "local", "world size 1: nothing is exchanged (dispatch/local.py)"
            self._memory = LocalMemory(self.device_index)
            _register(self)
            return
        # 1. Local checks (no allocation), then the descriptors: a bad argument or a disagreement on
        #    any rank is the same error on every rank, before anything is allocated.
        descriptor, error, asked = None, None, None
        try:
            _check_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
            asked = _check_backend(backend)
            device_index = torch.cuda.current_device()
            self._init_common(world_size, rank, max_tokens, hidden, dtype, device_index, timeout_s,
                              oneshot_max_tokens, ranks_on_device=1, vec_per_thread=vec_per_thread)
            gpu = _gpu_identity(device_index)
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
                backend=asked, symm_mem_unavailable=unavailable, nvlink_domain=domain, nvlink_note=note)
        except Exception as e:
            error = e
        self._closed = True  # until every rank has built it
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
        self._closed = False
        _register(self)

    def _build_ipc(self, device_index: int, dtype) -> None:
        import cupy
        from cupy.cuda import runtime
        group, error = self.group, None
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

    def _build_symm_mem(self, device_index: int, dtype) -> None:
        """The buffers from torch symmetric memory, mapped by torch's rendezvous on the group (a
        collective of torch's, over the group's store, entered by every rank or by none). cuMem
        keeps a block alive while a peer maps it, so a rank that fails after the rendezvous may
        release its memory at once."""
        group, error, offset = self.group, None, None
        try:
            try:
                self._memory = _RankMemory(device_index, self.buffer_elems, dtype.itemsize, buffers=_SymmMemBuffers)
            except Exception as e:
                error = e
            exchange_status(group, "allocating the buffers (torch symmetric memory)", error)
            try:
                offset = self._memory.block.rendezvous(group, self.rank, self.world_size)
            except Exception as e:
                error = e
            offsets = exchange_status(group, "mapping the peers' buffers (torch symmetric memory rendezvous)",
                                      error, offset)
            self._peer_buffers = self._memory.block.peer_pointers(offsets) + [0] * (registry.program_set().limits["max_world_size"] - self.world_size)
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
        """Collective: release the buffers and the peers' mappings (CUDA IPC: closed, then freed once
        every rank has closed its own; symmetric memory: the tensor and torch's handle dropped once
        every rank has finished its kernels and exchanged once more). If a rank cannot finish its
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
            self._recent_plans.clear()
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
            self._recent_plans.clear()
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
    `backend`: None or "ipc" (accepted for symmetry with Workspace; nothing crosses a process here).
    """

    def __init__(self, world_size: int, max_tokens: int, hidden: int, dtype: torch.dtype, *, devices=None,
                 timeout_s: float = 10.0, oneshot_max_tokens: int | None = None, vec_per_thread: int | None = None,
                 backend: str | None = None):
        import cupy
        from cupy.cuda import runtime
        _check_arguments(world_size, max_tokens, hidden, dtype, timeout_s, oneshot_max_tokens, vec_per_thread)
        if world_size == 1:
            raise ValueError("world_size: 1 has no peers to emulate; use dispatch.LocalWorkspace(max_tokens, hidden, "
                             "dtype)")
        if backend is not None and (not isinstance(backend, str) or backend != "ipc"):
            raise ValueError(f"backend: {backend!r}; EmulatedWorld keeps every rank in this process and reaches the "
                             f"peers' buffers directly (no CUDA IPC, no symmetric memory): pass None or 'ipc'")
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
