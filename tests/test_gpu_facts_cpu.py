"""The device's key that selection tables are matched against (dispatch/gpu_facts.py), without a GPU:
torch's properties and NVML's NVLink states through fakes of both."""
from __future__ import annotations

import types

import pytest

from dispatch import gpu_facts


class FakeNvml:
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def __init__(self, active=(), fail=None):
        self.active, self.fail, self.calls = set(active), fail, []

    def nvmlInit(self):
        if self.fail == "init":
            raise RuntimeError("nvmlInit_v2 returned 9")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if self.fail == "handle":
            raise RuntimeError("not found")
        self.calls.append(uuid)
        return "handle"

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= 18 or self.fail == "links":
            raise RuntimeError("not supported")
        return int(link in self.active)

    def nvmlDeviceGetNvLinkVersion(self, handle, link):
        return 4


class FakeCuda:
    def __init__(self, available=True):
        self.available = available

    def is_available(self):
        return self.available

    def get_device_properties(self, index):
        return types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                     uuid="0a1b2c3d-0000-0000-0000-000000000000")


@pytest.mark.parametrize("nvml,interconnect", [(FakeNvml(active=range(18)), "nvlink"), (FakeNvml(), "none"),
                                               (FakeNvml(fail="init"), "unknown"),
                                               (FakeNvml(fail="handle"), "unknown"),
                                               (FakeNvml(fail="links"), "none")])
def test_the_device_key_from_torch_and_nvml(nvml, interconnect):
    key = gpu_facts.describe_device(0, cuda=FakeCuda(), nvml=nvml)
    assert key == gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, interconnect)
    if nvml.fail not in ("init", "handle"):
        assert "GPU-0a1b2c3d-0000-0000-0000-000000000000" in nvml.calls and nvml.calls[-1] == "shutdown"
    assert gpu_facts.describe_device(0, cuda=FakeCuda(available=False), nvml=nvml) == gpu_facts.UNKNOWN_DEVICE
    state = gpu_facts.nvlink_state("GPU-x", FakeNvml(active={0, 1, 2}))
    assert state == {"kind": "nvlink", "links": 3, "generation": 4}
