"""The runtime's selection and manifest handling, without a GPU."""
import pathlib

import pytest

from dispatch import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_runtime_manifest_reader_is_the_generators_verbatim():
    # The runtime never imports the generator, so it keeps a copy of the stdlib verifier; the two
    # must not drift apart.
    assert (ROOT / "dispatch" / "manifest.py").read_bytes() == (ROOT / "generator" / "verify.py").read_bytes()


def _bounds(dtype, ws, profile):
    return registry.program_set().selection[(dtype, ws, profile)]


@pytest.mark.parametrize("ws", [2, 4, 8])
@pytest.mark.parametrize("profile", ["110", "111"])
def test_select_family_follows_the_committed_boundaries(ws, profile):
    b = _bounds("bf16", ws, profile)
    a, e = b["oneshot_max_tokens"], b["early_max_tokens"]
    big = 10 ** 6
    assert registry.select_family("bf16", ws, profile, a, False, big) == "oneshot"
    assert registry.select_family("bf16", ws, profile, a + 1, False, big) == ("twoshot_early" if e > a else "twoshot")
    assert registry.select_family("bf16", ws, profile, e + 1, False, big) == "twoshot"
    # a workspace whose one-shot buffer is smaller than the boundary caps the one-shot range
    if a > 1:
        assert registry.select_family("bf16", ws, profile, a, False, a - 1) != "oneshot"


def test_shared_variant_only_where_generated_and_holes_fall_back():
    # world size 2 has no shared variants (holes): the base family runs, named explicitly.
    e2 = _bounds("bf16", 2, "110")["early_max_tokens"]
    assert registry.select_family("bf16", 2, "110", e2 + 1, True, 10 ** 6) == "twoshot"
    e4 = _bounds("bf16", 4, "110")["early_max_tokens"]
    assert registry.select_family("bf16", 4, "110", e4 + 1, True, 10 ** 6) == "twoshot_shared"
    assert registry.program_for("twoshot_shared", "bf16", 2, "110") == "moe_ar_ts_bf16_ws2_o110"
    assert registry.program_for("twoshot_early_shared", "fp16", 8, "111") == "moe_ar_tse_fp16_ws8_o111"
