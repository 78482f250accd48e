"""The rendezvous of a Workspace: every rank checks its arguments, then the ranks exchange a
RankDescriptor (arguments, backend, buffer size, program-set hash, host and GPU identity, whether
torch symmetric memory is usable, the GPU's NVLink domain) before anything is allocated, and every
rank compares them identically: a disagreement is the same ValueError on every rank, and every rank
chooses the same backend. Each later fallible local step (allocation, CUDA IPC or torch's
rendezvous) ends in an exchange of its status instead of a barrier, so a rank that fails makes every
rank raise at once instead of leaving its peers waiting.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import socket

import torch

from . import registry


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
    selection: str = ""             # the table set and a digest of its boundaries (table_sets.Selection.label)


@dataclasses.dataclass(frozen=True)
class _Failure:
    """A rank's local step that raised, as its peers learn of it."""
    step: str
    error_type: str
    message: str
    value_error: bool


@dataclasses.dataclass(frozen=True)
class RendezvousOk:
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


def gpu_identity(device_index: int) -> str:
    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}" if not str(uuid).startswith("GPU-") else str(uuid)
    import cupy  # older torch: the PCI bus id is unique within a host
    return f"PCI {cupy.cuda.Device(device_index).pci_bus_id}"


def gather_status(group, step: str, error: BaseException | None, payload=None) -> list:
    """Collective on `group`: every rank's RendezvousOk(payload) or _Failure, in group rank order."""
    import torch.distributed as dist
    mine = RendezvousOk(payload) if error is None else _Failure(step, type(error).__name__, str(error),
                                                       isinstance(error, ValueError))
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def raise_failures(gathered: list, error: BaseException | None) -> list:
    """Every rank's payload if no rank failed; else the same exception on every rank: the ValueError of
    a rank whose arguments were bad (its message starts with the argument's name), else RuntimeError
    naming the step, the rank and its error. `error`: this rank's own, chained."""
    failed = [(r, g) for r, g in enumerate(gathered) if not isinstance(g, RendezvousOk)]
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
    raises on every rank alike (see raise_failures)."""
    return raise_failures(gather_status(group, step, error, payload), error)


def _show(field: str, value) -> str:
    if field == "timeout_ns":
        return "0 (no deadline)" if value == 0 else f"{value / 1e9:g} s"
    if field == "vec_per_thread" and value is None:
        return "None (chosen per call)"
    if field == "program_set":
        return f"programs with manifest sha256 {value[:16]}..."
    if field == "selection":
        return f"selection tables {value} (dispatch.selection_info says where each cell comes from)"
    return str(value)


_FIELD_ARGUMENT = {"timeout_ns": "timeout_s", "selection": "tables"}
_SAME = ("world_size", "backend", "program_set", "dtype", "hidden", "max_tokens", "selection", "oneshot_max_tokens",
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


def rendezvous_attempt(fn) -> BaseException | None:
    """Run a fallible local step; its exception, to be exchanged, or None."""
    try:
        fn()
    except Exception as e:
        return e
    return None
