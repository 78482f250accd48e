"""What this rank's GPU and torch offer the memory backends, read locally (no collective): whether
torch symmetric memory is usable (its module, its CUDA backend, the GPU's cuMem and export support,
through cuDeviceGetAttribute) and the GPU's NVLink domain (NVML's fabric registration). Every rank
computes its own; the rendezvous descriptors carry them."""
from __future__ import annotations

import ctypes
import functools
import inspect

import torch

# CUdevice_attribute values (cuda.h)
_CU_ATTR_VIRTUAL_MEMORY_MANAGEMENT = 102
_CU_ATTR_HANDLE_TYPE_POSIX_FD = 103
_CU_ATTR_HANDLE_TYPE_FABRIC = 128
_NVML_FABRIC_STATE_COMPLETED = 3


def symm_mem_module():
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
        symm = symm_mem_module()
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
