"""The stamp on a measurement: the machine, the software and the programs a time was taken with.

    stamp = collect([0, 1], peer_bandwidth_GBps=388.1)

gpu: product, count, SM count, compute capability (torch's device properties); interconnect: kind
(nvlink / none / unknown), NVLink generation and active links (NVML), the peer bandwidth the caller
measured (None at one GPU); driver (NVML); CUDA and torch (torch's build); NVRTC (the one the
runtime compiles with); the program set's sha256 (dispatch.workspace.program_set_sha256); the
commit; the date (the software and the driver: moe_ar_tools/provenance.py, the stamp of every
tool's results). NVML comes from pynvml (nvidia-ml-py) where it is installed, else the driver's
library through ctypes (dispatch.gpu_facts.NvmlLibrary); without either the interconnect is
"unknown" and the driver nvidia-smi's, where it is not "unknown" too. `match(stamp)` is the key a table set made from the stamped measurements is
matched on (dispatch/table_sets.py).
"""
from __future__ import annotations

import datetime

from moe_ar_tools import provenance


def software() -> dict:
    """CUDA and torch of torch's build, NVRTC, the program set's sha256 and the commit."""
    import torch
    from moe_ar_common import cuda_env
    from dispatch.rendezvous import program_set_sha256
    try:
        nvrtc = ".".join(map(str, cuda_env.load_nvrtc()[1]))
    except cuda_env.MissingToolchain:
        nvrtc = None
    return {"cuda": torch.version.cuda, "torch": torch.__version__, "nvrtc": nvrtc,
            "program_set_sha256": program_set_sha256(), "commit": provenance.git_commit()}


def collect(devices=None, *, peer_bandwidth_GBps: float | None = None, cuda=None, nvml="default",
            versions: dict | None = None) -> dict:
    """The stamp of measurements taken on `devices` (CUDA indices; default every visible GPU).
    ValueError naming `devices` where they are not all of one kind (a table set describes one).
    `cuda` (torch.cuda's interface), `nvml` (pynvml's; None: no NVML) and `versions` (software()'s
    dict) may be given in place of the machine's."""
    from dispatch import gpu_facts
    if cuda is None:
        import torch
        cuda = torch.cuda
    if nvml == "default":
        nvml = provenance.nvml_module()
    if not cuda.is_available():
        raise ValueError("devices: no CUDA GPU is visible; a stamp describes the GPUs a measurement ran on")
    devices = list(range(cuda.device_count())) if devices is None else list(devices)
    if not devices:
        raise ValueError("devices: no GPU given")
    probe = nvml if nvml is not None else _NoNvml()
    keys = [gpu_facts.describe_device(d, cuda=cuda, nvml=probe) for d in devices]
    for d, key in zip(devices[1:], keys[1:]):
        if key != keys[0]:
            raise ValueError(f"devices: GPU {devices[0]} is {keys[0].describe()}, GPU {d} is {key.describe()}; "
                             f"measure GPUs of one kind (CUDA_VISIBLE_DEVICES) for one table set")
    uuid = getattr(cuda.get_device_properties(devices[0]), "uuid", None)
    links = gpu_facts.nvlink_state(None if uuid is None else str(uuid), probe)
    key = keys[0]
    return {
        "gpu": {"product": key.product, "count": len(devices), "sm_count": key.sm_count,
                "capability": key.capability},
        "interconnect": {"kind": key.interconnect, "nvlink_generation": links["generation"],
                         "nvlink_links": links["links"], "peer_bandwidth_GBps": peer_bandwidth_GBps},
        "driver": provenance.driver_version(nvml),
        **(software() if versions is None else versions),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


class _NoNvml:
    """An NVML that is not there: every call fails, so the interconnect reads "unknown"."""
    NVML_NVLINK_MAX_LINKS = 0
    NVML_FEATURE_ENABLED = 1

    def nvmlInit(self):
        raise RuntimeError("no NVML")


def match(stamp: dict) -> dict:
    """The key of a table set made from measurements with this stamp (dispatch/table_sets.py
    user_set_mismatch compares it with the device's)."""
    gpu = stamp["gpu"]
    return {"product": gpu["product"], "capability": gpu["capability"], "sm_count": gpu["sm_count"],
            "interconnect": stamp["interconnect"]["kind"]}
