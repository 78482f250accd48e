"""The words and bits the kernels and the runtime share are declared once (generator/abi.py
SHARED_ENUMS): params.cuh renders them as C++ enums, the manifest carries them, the runtime reads
them from the manifest, and no kernel header defines them again."""
from __future__ import annotations

import pathlib
import re

from dispatch import rank_memory, registry, workspace_state
from generator import abi

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_params_header_and_manifest_carry_the_declared_enums():
    params = (ROOT / "generated" / "kernels" / "params.cuh").read_text()
    constants = registry.program_set().constants
    for name, _what, entries in abi.SHARED_ENUMS:
        block = re.search(r"enum %s \{(.*?)\};" % name, params, re.S)
        assert block, name
        rendered = dict(re.findall(r"(k\w+) = (\d+),", block.group(1)))
        assert {n: int(v) for n, v in rendered.items()} == {n: v for n, v, _ in entries} == constants[name], name


def test_no_kernel_header_defines_a_shared_enum_again():
    for header in (ROOT / "kernels").glob("*.cuh"):
        text = header.read_text()
        for name, _what, _entries in abi.SHARED_ENUMS:
            assert not re.search(r"enum (class )?%s\s*(:\s*\w+\s*)?\{" % name, text), (header.name, name)


def test_the_runtime_reads_them_from_the_manifest():
    words = registry.program_set().constants
    assert rank_memory.STATE_WORDS == words["StateWord"]["kStateWords"]
    assert rank_memory.STATE_BAD_ROWS == words["StateWord"]["kBadRows"]
    assert rank_memory.ERROR_WORDS == words["ErrorWord"]["kErrorWords"]
    # the launch path checks word 0 without a lookup: kErrCode must stay there
    assert words["ErrorWord"]["kErrCode"] == 0
    assert workspace_state.phase_meaning(words["Phase"]["kPhaseAllGather"]).startswith("all-gather")
    assert workspace_state.phase_meaning(99) == "99"


def test_the_regimes_the_runtime_names_are_the_manifests():
    ladder = [regime for regime, _field in registry.program_set().ladder]
    for regime in (registry.ONESHOT_REGIME, registry.LOCAL_LATENCY_REGIME, registry.LOCAL_STREAMING_REGIME):
        assert regime in ladder, (regime, ladder)
    assert (registry.LOCAL_LATENCY_REGIME, registry.LOCAL_LATENCY_FIELD) in registry.program_set().ladder
