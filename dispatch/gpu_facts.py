"""What this machine's GPU is, as the selection tables are matched against it: the product, compute
capability and SM count (torch's device properties) and the interconnect (NVML's NVLink states,
through the driver's libnvidia-ml.so.1 with ctypes; no Python package). table_sets.py chooses the
tables from this key; a measurement's stamp records the same.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    """What a table set is matched against."""
    product: str | None         # torch's device name, "NVIDIA H200"
    capability: str | None      # "9.0"
    sm_count: int | None
    interconnect: str           # "nvlink" (an active NVLink), "none", or "unknown" (no NVML to ask)

    def describe(self) -> str:
        return (f"{self.product or 'an unknown GPU'} (compute capability {self.capability}, {self.sm_count} SMs, "
                f"interconnect {self.interconnect})")


UNKNOWN_DEVICE = DeviceKey(None, None, None, "unknown")


class NvmlLibrary:
    """The few NVML calls used here, on the driver's libnvidia-ml.so.1 through ctypes (as torch.cuda
    loads it; no Python package), under pynvml's names, so that pynvml or a fake can stand in."""
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def __init__(self):
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")

    def _call(self, name: str, *args) -> None:
        code = getattr(self._lib, name)(*args)
        if code:
            raise RuntimeError(f"{name} returned {code}")

    def nvmlInit(self) -> None:
        self._call("nvmlInit_v2")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", str(uuid).encode(), ctypes.byref(handle))
        return handle

    def nvmlDeviceGetNvLinkState(self, handle, link: int) -> int:
        value = ctypes.c_uint()
        self._call("nvmlDeviceGetNvLinkState", handle, ctypes.c_uint(link), ctypes.byref(value))
        return value.value

    def nvmlDeviceGetNvLinkVersion(self, handle, link: int) -> int:
        value = ctypes.c_uint()
        self._call("nvmlDeviceGetNvLinkVersion", handle, ctypes.c_uint(link), ctypes.byref(value))
        return value.value

    def nvmlSystemGetDriverVersion(self) -> str:
        text = ctypes.create_string_buffer(96)
        self._call("nvmlSystemGetDriverVersion", text, ctypes.c_uint(96))
        return text.value.decode()


def nvml_library():
    """NVML of the driver (NvmlLibrary), None where the driver's library is not there."""
    try:
        return NvmlLibrary()
    except OSError:
        return None


def nvlink_state(uuid: str | None, nvml=None) -> dict:
    """{kind, links, generation} of a GPU's NVLinks through NVML (`nvml`: pynvml's interface, default
    the driver's library): kind "nvlink" where a link is active, "none" where NVML knows of none,
    "unknown" without NVML or the GPU's UUID."""
    nvml = nvml if nvml is not None else nvml_library()
    if nvml is None or not uuid:
        return {"kind": "unknown", "links": None, "generation": None}
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver library: nothing to ask
        return {"kind": "unknown", "links": None, "generation": None}
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if str(uuid).startswith("GPU-") else f"GPU-{uuid}")
        links, generation = 0, None
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                    links += 1
                    generation = generation or nvml.nvmlDeviceGetNvLinkVersion(handle, link)
            except Exception:  # noqa: BLE001 - a link the GPU does not have, or no NVLink at all
                continue
        return {"kind": "nvlink" if links else "none", "links": links, "generation": generation}
    except Exception:  # noqa: BLE001 - NVML present but the GPU not found through it
        return {"kind": "unknown", "links": None, "generation": None}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def describe_device(device_index: int, cuda=None, nvml=None) -> DeviceKey:
    """The key of a CUDA device (torch's properties, NVML for the interconnect); UNKNOWN_DEVICE where
    CUDA is not available. `cuda` (torch.cuda's interface) and `nvml` (NvmlLibrary's) may be fakes."""
    if cuda is None and nvml is None:
        return _described(device_index)
    return _describe(device_index, cuda, nvml)


@functools.lru_cache(maxsize=None)
def _described(device_index: int) -> DeviceKey:
    return _describe(device_index, None, None)


def _describe(device_index: int, cuda, nvml) -> DeviceKey:
    if cuda is None:
        import torch
        cuda = torch.cuda
    if not cuda.is_available():
        return UNKNOWN_DEVICE
    props = cuda.get_device_properties(device_index)
    uuid = getattr(props, "uuid", None)
    return DeviceKey(props.name, f"{props.major}.{props.minor}", int(props.multi_processor_count),
                     nvlink_state(None if uuid is None else str(uuid), nvml)["kind"])
