"""The stamp on a measurement (moe_ar_tools/stamp.py), collected with fakes of torch.cuda and NVML."""
from __future__ import annotations

import types

import pytest

from moe_ar_tools import provenance, stamp

VERSIONS = {"cuda": "13.0", "torch": "2.13.0+cu130", "nvrtc": "13.0", "program_set_sha256": "ab" * 32,
            "commit": "0123abc"}


class FakeNvml:
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1

    def __init__(self, links=18, version=4, driver="580.159.04"):
        self.links, self.version, self.driver = links, version, driver

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetNvLinkState(self, handle, link):
        return int(link < self.links)

    def nvmlDeviceGetNvLinkVersion(self, handle, link):
        return self.version

    def nvmlSystemGetDriverVersion(self):
        return self.driver.encode()  # older pynvml returns bytes


class FakeCuda:
    def __init__(self, names=("NVIDIA H200", "NVIDIA H200"), sms=(132, 132)):
        self.names, self.sms = names, sms

    def is_available(self):
        return bool(self.names)

    def device_count(self):
        return len(self.names)

    def get_device_properties(self, index):
        return types.SimpleNamespace(name=self.names[index], major=9, minor=0, multi_processor_count=self.sms[index],
                                     uuid=f"0000000{index}-0000-0000-0000-000000000000")


def test_a_stamp_names_the_machine_the_software_and_the_programs():
    got = stamp.collect(peer_bandwidth_GBps=388.06, cuda=FakeCuda(), nvml=FakeNvml(), versions=VERSIONS)
    date = got.pop("date")
    assert len(date) == 19 and date[4] == "-"
    assert got == {"gpu": {"product": "NVIDIA H200", "count": 2, "sm_count": 132, "capability": "9.0"},
                   "interconnect": {"kind": "nvlink", "nvlink_generation": 4, "nvlink_links": 18,
                                    "peer_bandwidth_GBps": 388.06},
                   "driver": "580.159.04", **VERSIONS}
    assert stamp.match(got) == {"product": "NVIDIA H200", "capability": "9.0", "sm_count": 132,
                                "interconnect": "nvlink"}


def test_one_gpu_without_nvlink_or_nvml(monkeypatch):
    monkeypatch.setattr(provenance, "_tools_driver", lambda: None)  # no nvidia-smi, no driver for CuPy
    one = stamp.collect([0], cuda=FakeCuda(("NVIDIA H200",), (132,)), nvml=FakeNvml(links=0), versions=VERSIONS)
    assert one["gpu"]["count"] == 1 and one["interconnect"] == {
        "kind": "none", "nvlink_generation": None, "nvlink_links": 0, "peer_bandwidth_GBps": None}
    blind = stamp.collect([1], cuda=FakeCuda(), nvml=None, versions=VERSIONS)
    assert blind["interconnect"]["kind"] == "unknown" and blind["driver"] == "unknown"
    assert blind["gpu"]["product"] == "NVIDIA H200"  # torch still names the GPU


def test_gpus_of_two_kinds_or_none_are_refused():
    with pytest.raises(ValueError, match=r"^devices: GPU 0 is NVIDIA H200 .*GPU 1 is NVIDIA H100"):
        stamp.collect(cuda=FakeCuda(("NVIDIA H200", "NVIDIA H100")), nvml=FakeNvml(), versions=VERSIONS)
    with pytest.raises(ValueError, match=r"^devices: GPU 0 is .*132 SMs.*GPU 1 is .*66 SMs"):  # a MIG slice, say
        stamp.collect(cuda=FakeCuda(sms=(132, 66)), nvml=FakeNvml(), versions=VERSIONS)
    with pytest.raises(ValueError, match="^devices: no CUDA GPU"):
        stamp.collect(cuda=FakeCuda(()), nvml=FakeNvml(), versions=VERSIONS)


def test_the_software_part_is_the_runtimes():
    from dispatch.workspace import program_set_sha256
    got = stamp.software()
    assert got["program_set_sha256"] == program_set_sha256() and got["torch"]
    assert set(got) == set(VERSIONS)
