"""No wrong kernel ever runs, and no bad call gets past the checks (CPU, no GPU needed).

- A corrupted compile-cache entry is recompiled, never loaded; a tampered generated source or a
  manifest that does not match stops compilation with an error naming the file.
- Hostile arguments (hypothesis): every invalid call raises ValueError whose message starts with
  the name of the argument that is wrong.
"""
from __future__ import annotations

import pathlib
import shutil
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch import manifest as runtime_manifest
from dispatch import op, registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAM = "moe_ar_os_bf16_ws2_o110"


# ---- compile cache and sources --------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_AR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_corrupt_cache_entry_is_recompiled_not_loaded(cache):
    cubin, info = registry.cached_cubin(PROGRAM, "sm_90a")
    assert info["source"] == "compiled"
    (entry,) = cache.glob("*.cubin")
    again, info = registry.cached_cubin(PROGRAM, "sm_90a")
    assert info["source"] == "cache" and again == cubin
    blob = bytearray(entry.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped bit inside the cubin
    entry.write_bytes(bytes(blob))
    fresh, info = registry.cached_cubin(PROGRAM, "sm_90a")
    assert info["source"] == "compiled" and info.get("cache_corrupt") is True
    assert fresh == cubin
    assert registry.cached_cubin(PROGRAM, "sm_90a")[1]["source"] == "cache"  # the entry was rewritten


def test_cache_key_covers_the_inlined_body(cache):
    # The cache key hashes the self-contained source: the body text is part of it.
    ps = registry.program_set()
    source = runtime_manifest.source_for(ps.manifest, ps.dir, PROGRAM)
    body = (ps.dir / ps.manifest["body"]["file"]).read_text()
    assert body in source and "#include \"moe_finalize_allreduce.cuh\"" not in source
    assert registry._cache_key(source, "sm_90a") != registry._cache_key(source + "\n", "sm_90a")


@pytest.fixture
def generated_copy(tmp_path):
    dest = tmp_path / "generated"
    shutil.copytree(ROOT / "generated", dest)
    return dest


def test_tampered_program_source_is_refused_by_name(generated_copy):
    manifest = runtime_manifest.load_verified_manifest(generated_copy)
    path = generated_copy / "programs" / f"{PROGRAM}.cu"
    path.write_text(path.read_text().replace("moe_ar::run<", "moe_ar::run< "))
    with pytest.raises(runtime_manifest.ManifestError, match=rf"generated/programs/{PROGRAM}\.cu: does not match"):
        runtime_manifest.source_for(manifest, generated_copy, PROGRAM)
    with pytest.raises(runtime_manifest.ManifestError, match="gen-programs"):
        runtime_manifest.load_verified_manifest(generated_copy)


def test_tampered_body_and_mismatched_manifest_are_refused(generated_copy):
    body = generated_copy / "kernels" / "moe_finalize_allreduce.cuh"
    body.write_text(body.read_text().replace("kSentinelWord = 0x80008000u", "kSentinelWord = 0x80000000u"))
    with pytest.raises(runtime_manifest.ManifestError, match="kernels/moe_finalize_allreduce.cuh"):
        runtime_manifest.load_verified_manifest(generated_copy)
    shutil.copy(ROOT / "generated" / "kernels" / "moe_finalize_allreduce.cuh", body)
    m = generated_copy / "manifest.json"
    known = runtime_manifest.FORMAT  # a format this reader does not know: the next one
    m.write_text(m.read_text().replace(f'"format": {known},', f'"format": {known + 1},'))
    with pytest.raises(runtime_manifest.ManifestError, match="format"):
        runtime_manifest.load_verified_manifest(generated_copy)


# ---- hostile arguments ------------------------------------------------------------------------

H, T, K, MAX_T = 64, 5, 3, 16
D = torch.bfloat16


def _workspace():
    """What the argument checks read from a workspace, on the CPU."""
    return types.SimpleNamespace(dtype=D, hidden=H, device=torch.device("cpu"), max_tokens=MAX_T)


def _valid():
    R = T * K + 2
    return dict(op._DEFAULTS, allreduce_in=torch.randn(R, H).to(D),
                expanded_idx_to_permuted_idx=torch.randperm(R)[:T * K].view(T, K).int(),
                expert_scale_factor=torch.rand(T, K), shared_expert_output=torch.randn(T, H).to(D),
                residual_in=torch.randn(T, H).to(D), norm_weight=torch.randn(H).to(D), eps=1e-6,
                quant="nvfp4", global_scale=torch.tensor([1.0]),
                norm_out=torch.empty(T, H, dtype=D), residual_out=torch.empty(T, H, dtype=D),
                quant_out=torch.empty(T, H // 2, dtype=torch.uint8),
                scale_out=torch.empty(op.scale_out_bytes(T, H), dtype=torch.uint8))


TENSORS = ("allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
           "residual_in", "norm_weight", "global_scale", "norm_out", "residual_out", "quant_out", "scale_out")


def _wrong_dtype(x):
    return x.to(torch.float64) if x.dtype != torch.float64 else x.to(torch.float32)


def _wrong_shape(x):
    if x.dtype == torch.int32:  # the routing defines T and K: a wrong one is one that is not 2-D
        return x.flatten()
    if x.dim() == 1 and x.dtype == torch.uint8:  # scale_out may be longer than needed, not 2-D
        return x.view(1, -1)
    return torch.cat([x, x[..., :1]], dim=-1)  # one column (or element) too many


def _non_contiguous(x):
    if x.dim() == 2 and x.shape[1] > 1:
        return torch.cat([x, x], dim=1)[:, ::2]
    return torch.stack([x, x], dim=-1)[..., 0]


MUTATIONS = {
    "dtype": _wrong_dtype,
    "shape": _wrong_shape,
    "non-contiguous": _non_contiguous,
    "not a tensor": lambda x: x.tolist(),
}


def test_valid_call_passes_the_checks():
    assert op._check_args(_workspace(), _valid()) == (T, K, T * K + 2, "nvfp4")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(TENSORS), how=st.sampled_from(sorted(MUTATIONS)))
def test_a_bad_tensor_is_named(name, how):
    a = _valid()
    bad = MUTATIONS[how](a[name])
    if isinstance(bad, torch.Tensor) and bad.shape == a[name].shape and bad.dtype == a[name].dtype \
            and bad.is_contiguous():
        return  # the mutation did not change anything checkable (e.g. a 1-element tensor)
    a[name] = bad
    with pytest.raises(ValueError) as e:
        op._check_args(_workspace(), a)
    # An index tensor that is not 2-D cannot say how many tokens there are: it is named too.
    assert str(e.value).startswith(name + ":"), (name, how, str(e.value))


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from([
    ("expanded_idx_to_permuted_idx", lambda a: a.update(expanded_idx_to_permuted_idx=torch.zeros(MAX_T + 1, K,
                                                                                            dtype=torch.int32))),
    ("expanded_idx_to_permuted_idx", lambda a: a.update(expanded_idx_to_permuted_idx=torch.zeros(T, 0,
                                                                                            dtype=torch.int32))),
    ("expanded_idx_to_permuted_idx", lambda a: a.update(expanded_idx_to_permuted_idx=torch.zeros(T, op.MAX_TOP_K + 1,
                                                                                            dtype=torch.int32))),
    ("allreduce_in", lambda a: a.update(allreduce_in=a["allreduce_in"][: T * K - 1])),
    ("allreduce_in", lambda a: a.update(allreduce_in=torch.randn(T * K + 2, H + 16).to(D))),
    ("quant", lambda a: a.update(quant="fp4")),
    ("global_scale", lambda a: a.update(global_scale=None)),
    ("weight_bias", lambda a: a.update(weight_bias=2)),
    ("eps", lambda a: a.update(eps="1e-6")),
    ("routed_scaling_factor", lambda a: a.update(routed_scaling_factor=torch.tensor(1.0))),
    ("scale_out", lambda a: a.update(scale_out=a["scale_out"][:-1])),
]), seed=st.integers(0, 2 ** 16))
def test_a_bad_value_is_named(case, seed):
    name, mutate = case
    torch.manual_seed(seed)
    a = _valid()
    mutate(a)
    with pytest.raises(ValueError) as e:
        op._check_args(_workspace(), a)
    assert str(e.value).startswith(name + ":"), (name, str(e.value))
