"""No wrong kernel ever runs, and no bad call gets past the checks (CPU, no GPU needed).

- A corrupted compile-cache entry is recompiled, never loaded; a tampered generated source or a
  manifest that does not match stops compilation with an error naming the file.
- Hostile arguments (hypothesis): every invalid call raises ValueError whose message starts with
  the name of the argument that is wrong.
"""
from __future__ import annotations

import math
import pathlib
import shutil
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatch import op, registry
from dispatch.call_arguments import CALL_DEFAULTS, MAX_TOP_K, check_call_arguments
from dispatch.overlaps import check_rank_overlaps
from dispatch.workspace_state import WorkspaceState

from moe_ar_common import manifest_reader
from moe_ar_tools import reference as ref

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROGRAM = "moe_ar_oneshot_bf16_ws2_plain"


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
    # The cache key hashes the self-contained source: the text of every body header is part of it.
    ps = registry.program_set()
    source = manifest_reader.source_for(ps.manifest, ps.dir, PROGRAM)
    assert manifest_reader.body_source(ps.manifest, ps.dir) in source
    assert not any(manifest_reader.quoted_include(line) for line in source.splitlines())
    assert registry._cache_key(source, "sm_90a") != registry._cache_key(source + "\n", "sm_90a")


@pytest.fixture
def generated_copy(tmp_path):
    dest = tmp_path / "generated"
    shutil.copytree(ROOT / "generated", dest)
    return dest


def test_tampered_program_source_is_refused_by_name(generated_copy):
    manifest = manifest_reader.load_verified_manifest(generated_copy)
    path = generated_copy / "programs" / f"{PROGRAM}.cu"
    path.write_text(path.read_text().replace("moe_ar::run<", "moe_ar::run< "))
    with pytest.raises(manifest_reader.ManifestError, match=rf"generated/programs/{PROGRAM}\.cu: does not match"):
        manifest_reader.source_for(manifest, generated_copy, PROGRAM)
    with pytest.raises(manifest_reader.ManifestError, match="gen-programs"):
        manifest_reader.load_verified_manifest(generated_copy)


def test_tampered_body_and_mismatched_manifest_are_refused(generated_copy):
    header = generated_copy / "kernels" / "lamport.cuh"
    header.write_text(header.read_text().replace("kSentinelWord = 0x80008000u", "kSentinelWord = 0x80000000u"))
    with pytest.raises(manifest_reader.ManifestError, match="generated/kernels/lamport.cuh: does not match"):
        manifest_reader.load_verified_manifest(generated_copy)
    shutil.copy(ROOT / "generated" / "kernels" / "lamport.cuh", header)
    m = generated_copy / "manifest.json"
    known = manifest_reader.FORMAT  # a format this reader does not know: the next one
    m.write_text(m.read_text().replace(f'"format": {known},', f'"format": {known + 1},'))
    with pytest.raises(manifest_reader.ManifestError, match="format"):
        manifest_reader.load_verified_manifest(generated_copy)


# ---- hostile arguments ------------------------------------------------------------------------

H, T, K, MAX_T = 64, 5, 3, 16
D = torch.bfloat16


def _workspace():
    """What the argument checks read from a workspace, on the CPU."""
    return types.SimpleNamespace(dtype=D, hidden=H, device=torch.device("cpu"), max_tokens=MAX_T)


def _valid():
    R = T * K + 2
    return dict(CALL_DEFAULTS, allreduce_in=torch.randn(R, H).to(D),
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
    assert check_call_arguments(_workspace(), _valid()) == (T, K, T * K + 2, "nvfp4")


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
        check_call_arguments(_workspace(), a)
    # An index tensor that is not 2-D cannot say how many tokens there are: it is named too.
    assert str(e.value).startswith(name + ":"), (name, how, str(e.value))


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from([
    ("expanded_idx_to_permuted_idx", lambda a: a.update(expanded_idx_to_permuted_idx=torch.zeros(MAX_T + 1, K,
                                                                                            dtype=torch.int32))),
    ("expanded_idx_to_permuted_idx", lambda a: a.update(expanded_idx_to_permuted_idx=torch.zeros(T, 0,
                                                                                            dtype=torch.int32))),
    ("expanded_idx_to_permuted_idx", lambda a: a.update(expanded_idx_to_permuted_idx=torch.zeros(T, MAX_TOP_K + 1,
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
        check_call_arguments(_workspace(), a)
    assert str(e.value).startswith(name + ":"), (name, str(e.value))


# ---- outputs that overlap inputs or each other; scalars; unused arguments --------------------------

H2 = 128  # a multiple of 128: every quant's outputs exist
QUANTS = (None, "nvfp4", "fp8_group128", "fp8_tensor")
OUTPUTS = ("norm_out", "residual_out", "quant_out", "scale_out")
INPUTS = ("allreduce_in", "expanded_idx_to_permuted_idx", "expert_scale_factor", "shared_expert_output",
          "residual_in", "norm_weight", "global_scale", "fp8_scale")


def _ws2():
    return types.SimpleNamespace(dtype=D, hidden=H2, device=torch.device("cpu"), max_tokens=MAX_T)


def _call(quant, seed=0):
    """A valid call with every argument `quant` uses given (outputs included), and nothing else."""
    g = torch.Generator().manual_seed(seed)
    R = T * K + 2
    a = dict(CALL_DEFAULTS, allreduce_in=torch.randn(R, H2, generator=g).to(D),
             expanded_idx_to_permuted_idx=torch.randperm(R, generator=g)[:T * K].view(T, K).int(),
             expert_scale_factor=torch.rand(T, K, generator=g), shared_expert_output=torch.randn(T, H2).to(D),
             residual_in=torch.randn(T, H2, generator=g).to(D), norm_weight=torch.randn(H2, generator=g).to(D),
             norm_out=torch.empty(T, H2, dtype=D), residual_out=torch.empty(T, H2, dtype=D), quant=quant)
    if quant == "nvfp4":
        a.update(global_scale=torch.tensor([1.0]), quant_out=torch.empty(T, H2 // 2, dtype=torch.uint8),
                 scale_out=torch.empty(op.scale_out_bytes(T, H2), dtype=torch.uint8))
    if quant == "fp8_group128":
        a.update(quant_out=torch.empty(T, H2, dtype=torch.float8_e4m3fn),
                 scale_out=torch.empty(op.fp8_scale_shape(T, H2), dtype=torch.float32))
    if quant == "fp8_tensor":
        a.update(fp8_scale=torch.tensor([1.0]), quant_out=torch.empty(T, H2, dtype=torch.float8_e4m3fn))
    return a


def _used(a):
    return ([n for n in OUTPUTS if a[n] is not None], [n for n in INPUTS if a[n] is not None])


def _nbytes(t):
    return t.numel() * t.element_size()


def _share(a, first, second, offset):
    """a[first] at byte 0 and a[second] at byte `offset` of one buffer (shapes and dtypes kept)."""
    x, y = a[first], a[second]
    buf = torch.zeros(max(_nbytes(x), offset + _nbytes(y)) + 64, dtype=torch.uint8)
    assert buf.data_ptr() % 16 == 0 and offset % 16 == 0
    for name, t, off in ((first, x, 0), (second, y, offset)):
        a[name] = buf[off:off + _nbytes(t)].view(t.dtype).view(t.shape)
    return a


OVERLAP_MODES = {
    "same start": lambda nx: 0,
    "at the last 16 bytes": lambda nx: (nx - 1) // 16 * 16,
}


def _overlap_cases():
    cases = []
    for quant in QUANTS:
        outs, ins = _used(_call(quant))
        for o in outs:
            for i in ins:
                for mode in OVERLAP_MODES:
                    for order in ("output first", "input first"):
                        cases.append(pytest.param(quant, o, i, mode, order, id=f"{quant}-{o}-{i}-{mode}-{order}"))
    return cases


@pytest.mark.parametrize("quant,out,inp,mode,order", _overlap_cases())
def test_an_output_overlapping_an_input_is_named(quant, out, inp, mode, order):
    a = _call(quant)
    first, second = (out, inp) if order == "output first" else (inp, out)
    _share(a, first, second, OVERLAP_MODES[mode](_nbytes(a[first])))
    if (out, inp) == ("residual_out", "residual_in") and mode == "same start":
        assert check_call_arguments(_ws2(), a)[0] == T  # exactly residual_in: in place, allowed
        return
    with pytest.raises(ValueError) as e:
        check_call_arguments(_ws2(), a)
    msg = str(e.value)
    assert msg.startswith(out + ":") and inp in msg, msg


def _output_pairs():
    cases = []
    for quant in QUANTS:
        outs, _ = _used(_call(quant))
        for j, o2 in enumerate(outs):
            for o1 in outs[:j]:
                for mode in OVERLAP_MODES:
                    for order in ("in order", "reversed"):
                        cases.append(pytest.param(quant, o1, o2, mode, order, id=f"{quant}-{o1}-{o2}-{mode}-{order}"))
    return cases


@pytest.mark.parametrize("quant,o1,o2,mode,order", _output_pairs())
def test_two_overlapping_outputs_are_named(quant, o1, o2, mode, order):
    a = _call(quant)
    first, second = (o1, o2) if order == "in order" else (o2, o1)
    _share(a, first, second, OVERLAP_MODES[mode](_nbytes(a[first])))
    with pytest.raises(ValueError) as e:
        check_call_arguments(_ws2(), a)
    msg = str(e.value)
    assert msg.startswith(o1 + ":") and o2 in msg, msg  # the first of norm_out, residual_out, quant_out, scale_out


@pytest.mark.parametrize("quant", QUANTS)
def test_adjacent_tensors_do_not_overlap(quant):
    """Every used tensor packed back to back in one buffer (each at a 16-byte boundary): no overlap."""
    a = _call(quant)
    outs, ins = _used(a)
    names = outs + ins
    offsets, at = [], 0
    for n in names:
        offsets.append(at)
        at += -(-_nbytes(a[n]) // 16) * 16
    buf = torch.zeros(at + 64, dtype=torch.uint8)
    for n, off in zip(names, offsets):
        t = a[n]
        a[n] = buf[off:off + _nbytes(t)].view(t.dtype).view(t.shape)
    assert check_call_arguments(_ws2(), a)[0] == T


def test_natural_memory_reuse_is_refused():
    a = _call(None)
    a["norm_out"] = a["allreduce_in"][:T]  # R >= T * K rows: a tempting buffer to reuse
    with pytest.raises(ValueError, match=r"^norm_out: .*allreduce_in"):
        check_call_arguments(_ws2(), a)
    a = _call("nvfp4")
    a["residual_out"] = a["norm_out"]
    with pytest.raises(ValueError, match=r"^norm_out: .*residual_out"):
        check_call_arguments(_ws2(), a)
    a = _call(None)
    a["norm_out"] = a["residual_in"]
    with pytest.raises(ValueError, match=r"^norm_out: .*residual_in"):
        check_call_arguments(_ws2(), a)
    a = _call(None)
    a["residual_out"] = a["residual_in"]  # in place: allowed
    a["shared_expert_output"] = a["residual_in"]  # but then residual_out overwrites what the kernel reads
    with pytest.raises(ValueError, match=r"^residual_out: .*shared_expert_output"):
        check_call_arguments(_ws2(), a)


@pytest.mark.parametrize("quant", QUANTS)
def test_residual_out_may_be_residual_in_itself(quant):
    a = _call(quant)
    a["residual_out"] = a["residual_in"]
    assert check_call_arguments(_ws2(), a)[0] == T
    a["residual_out"] = a["residual_in"].view(T, H2)  # another tensor object, the same memory
    assert check_call_arguments(_ws2(), a)[0] == T


@pytest.mark.parametrize("shift_bytes", [16, -16, 2 * H2])
def test_residual_out_partly_over_residual_in_is_refused(shift_bytes):
    a = _call(None)
    n = _nbytes(a["residual_in"])
    buf = torch.zeros(n + abs(shift_bytes) + 64, dtype=torch.uint8)
    base = max(0, -shift_bytes)
    a["residual_in"] = buf[base:base + n].view(D).view(T, H2)
    a["residual_out"] = buf[base + shift_bytes:base + shift_bytes + n].view(D).view(T, H2)
    with pytest.raises(ValueError, match=r"^residual_out: .*residual_in"):
        check_call_arguments(_ws2(), a)


def test_empty_tensors_overlap_nothing():
    """T = 0: the outputs are empty; an empty tensor at an address inside another is no overlap."""
    a = _call("nvfp4")
    T0 = 0
    a.update(expanded_idx_to_permuted_idx=torch.zeros(T0, K, dtype=torch.int32), expert_scale_factor=None,
             shared_expert_output=None, residual_in=torch.empty(T0, H2, dtype=D),
             norm_out=a["allreduce_in"][:0], residual_out=a["allreduce_in"][:0],
             quant_out=torch.empty(T0, H2 // 2, dtype=torch.uint8), scale_out=torch.empty(0, dtype=torch.uint8))
    assert check_call_arguments(_ws2(), a)[0] == 0


# -- EmulatedWorld.run: a rank's outputs against every other rank's tensors --

def _prepared(quant, seed):
    a = _call(quant, seed)
    check_call_arguments(_ws2(), a)
    return a


def test_rank_overlaps_other_ranks_tensors_are_named():
    check = check_rank_overlaps
    r0, r1 = _prepared("nvfp4", 0), _prepared("nvfp4", 1)
    check([r0, r1])  # independent tensors
    shared = dict(r1, norm_weight=r0["norm_weight"], residual_in=r0["residual_in"],
                  expanded_idx_to_permuted_idx=r0["expanded_idx_to_permuted_idx"])
    check([r0, shared])  # inputs may be shared by ranks
    bad = dict(r1, norm_out=r0["residual_in"])
    with pytest.raises(ValueError, match=r"^per_rank_kwargs\[1\]: norm_out .*residual_in.*per_rank_kwargs\[0\]"):
        check([r0, bad])
    bad = dict(r1, scale_out=r0["scale_out"])
    with pytest.raises(ValueError, match=r"^per_rank_kwargs\[\d\]: scale_out .*scale_out.*per_rank_kwargs\[\d\]"):
        check([r0, bad])
    # in place on rank 0 while rank 1 reads the same residual_in tensor
    inplace = dict(r0, residual_out=r0["residual_in"])
    reader = dict(r1, residual_in=r0["residual_in"])
    with pytest.raises(ValueError, match=r"^per_rank_kwargs\[0\]: residual_out .*residual_in.*per_rank_kwargs\[1\]"):
        check([inplace, reader])
    # an input of rank 0 inside an output of rank 2
    r2 = _prepared(None, 2)
    buf = torch.zeros(_nbytes(r2["norm_out"]), dtype=torch.uint8)
    r2 = dict(r2, norm_out=buf.view(D).view(T, H2))
    r0b = dict(r0, global_scale=buf[64:68].view(torch.float32))
    with pytest.raises(ValueError, match=r"^per_rank_kwargs\[2\]: norm_out .*global_scale.*per_rank_kwargs\[0\]"):
        check([r0b, r1, r2])


# -- scalars --

BAD_SCALARS = [
    ("eps", v) for v in (0.0, -0.0, -1e-6, math.nan, math.inf, -math.inf, True, False, 1e-46, 1e39, 10 ** 400, None,
                         "1e-6", torch.tensor(1e-6))
] + [
    ("routed_scaling_factor", v) for v in (math.nan, math.inf, -math.inf, True, False, 1e39, -1e39, 10 ** 400, None,
                                           "2")
] + [
    ("weight_bias", v) for v in (True, False, 1.0, 0.0, math.nan, 2, -1, "1", None)
] + [
    ("launch_with_pdl", v) for v in (1, 0, None, "yes")
] + [
    ("program", v) for v in (5, b"moe_ar_oneshot_bf16_ws2_plain", ["moe_ar_oneshot_bf16_ws2_plain"])
]


@pytest.mark.parametrize("name,value", BAD_SCALARS, ids=[f"{n}={v!r}"[:40] for n, v in BAD_SCALARS])
def test_a_bad_scalar_is_named(name, value):
    a = _call(None)
    a[name] = value
    with pytest.raises(ValueError) as e:
        check_call_arguments(_ws2(), a)
    assert str(e.value).startswith(name + ":"), str(e.value)


GOOD_SCALARS = [("eps", v) for v in (1e-6, 1, 1e-45, 3e38, 2.0 ** -149)] + \
    [("routed_scaling_factor", v) for v in (0.0, -0.0, -2.5, 3e38, 2, -3.4e38)] + \
    [("weight_bias", v) for v in (0, 1)] + [("launch_with_pdl", v) for v in (False, True)] + \
    [("program", v) for v in (None, "moe_ar_oneshot_bf16_ws2_plain")]


@pytest.mark.parametrize("name,value", GOOD_SCALARS, ids=[f"{n}={v!r}" for n, v in GOOD_SCALARS])
def test_a_good_scalar_passes(name, value):
    a = _call(None)
    a[name] = value
    assert check_call_arguments(_ws2(), a)[0] == T


# -- arguments the quant does not use --

UNUSED = [
    ("global_scale", lambda: torch.tensor([1.0]), q) for q in (None, "fp8_group128", "fp8_tensor")
] + [
    ("fp8_scale", lambda: torch.tensor([1.0]), q) for q in (None, "nvfp4", "fp8_group128")
] + [
    ("quant_out", lambda: torch.empty(T, H2 // 2, dtype=torch.uint8), None),
    ("quant_out", lambda: torch.empty(T, H2, dtype=torch.float8_e4m3fn), None),
    ("scale_out", lambda: torch.empty(op.scale_out_bytes(T, H2), dtype=torch.uint8), None),
    ("scale_out", lambda: torch.empty(op.fp8_scale_shape(T, H2), dtype=torch.float32), None),
    ("scale_out", lambda: torch.empty(op.fp8_scale_shape(T, H2), dtype=torch.float32), "fp8_tensor"),
] + [
    ("fp8_scale_layout", lambda: "column", q) for q in (None, "nvfp4", "fp8_tensor")
] + [
    ("fp8_pow2_scales", lambda: True, q) for q in (None, "nvfp4", "fp8_tensor")
]


@pytest.mark.parametrize("name,make,quant", UNUSED, ids=[f"{n}-{q}-{i}" for i, (n, _, q) in enumerate(UNUSED)])
def test_an_argument_the_quant_does_not_use_is_named(name, make, quant):
    a = _call(quant)
    a[name] = make()
    with pytest.raises(ValueError) as e:
        check_call_arguments(_ws2(), a)
    assert str(e.value).startswith(name + ":") and repr(quant) in str(e.value), str(e.value)


@pytest.mark.parametrize("quant", QUANTS)
def test_defaults_of_the_fp8_options_pass_with_any_quant(quant):
    a = _call(quant)
    a.update(fp8_scale_layout="row", fp8_pow2_scales=False)
    assert check_call_arguments(_ws2(), a)[0] == T


# -- the torch op and the FlashInfer entry pass scalars through unconverted --

class _StubWorkspace:
    """What the keyword op wrapper and the FlashInfer entry read before they call the runtime."""

    def __init__(self, device="cpu"):
        self.device, self.hidden, self.dtype, self.dtype_name = torch.device(device), H2, D, "bf16"
        self.world_size, self.rank, self.max_tokens, self.oneshot_max_tokens = 2, 0, MAX_T, MAX_T
        self._moe_ar_state = WorkspaceState()
        self._moe_ar_state.memory = types.SimpleNamespace(error=[0])  # no timeout recorded


@pytest.mark.parametrize("name,value", [("weight_bias", True), ("weight_bias", 1.5), ("weight_bias", "1"),
                                        ("eps", "1e-6"), ("eps", math.nan), ("eps", 0.0), ("eps", True),
                                        ("routed_scaling_factor", math.inf), ("routed_scaling_factor", "2"),
                                        ("launch_with_pdl", 1), ("fp8_pow2_scales", 1)])
def test_the_keyword_op_refuses_before_converting(name, value):
    """Refused by the wrapper itself: the launch is replaced by a failure, so nothing may reach it."""
    import dispatch
    ws = _StubWorkspace()
    a = _call("fp8_group128")
    kw = {k: a[k] for k in ("allreduce_in", "expanded_idx_to_permuted_idx", "residual_in", "norm_weight")}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(op, "prepare_call", lambda *a, **k: pytest.fail("the call reached the runtime"))
        with pytest.raises(ValueError, match=rf"^{name}: "):
            dispatch.moe_finalize_allreduce_op(dispatch.workspace_handle(ws), **kw, quant="fp8_group128",
                                               **{name: value})


@pytest.mark.parametrize("name,value", [("eps", "1e-6"), ("eps", math.nan), ("eps", -1.0), ("eps", None),
                                        ("routed_scaling_factor", math.nan), ("routed_scaling_factor", "2"),
                                        ("routed_scaling_factor", True), ("launch_with_pdl", 1),
                                        ("launch_with_pdl", None)])
def test_the_flashinfer_entry_refuses_before_converting(name, value):
    from dispatch.flashinfer_compat import trtllm_moe_finalize_allreduce_fusion
    ws = _StubWorkspace()
    a = _call(None)
    args = dict(allreduce_in=a["allreduce_in"], residual_in=a["residual_in"], norm_weight=a["norm_weight"],
                expanded_idx_to_permuted_idx=a["expanded_idx_to_permuted_idx"], norm_out=None, residual_out=None,
                quant_out=None, scale_out=None, workspace_ptrs=ws, launch_with_pdl=False, world_rank=0, world_size=2,
                eps=1e-6, shared_expert_output=None, expert_scale_factor=None, routed_scaling_factor=None)
    args[name] = value
    with pytest.MonkeyPatch.context() as m:
        m.setattr(op, "prepare_call", lambda *a, **k: pytest.fail("the call reached the runtime"))
        with pytest.raises(ValueError, match=rf"^{name}: "):
            trtllm_moe_finalize_allreduce_fusion(**args)


# ---- device scales the host cannot check: the bytes the rule gives (dispatch/API.md's table) ---------

def _norm_rows():
    """bf16 norm_out-like rows: random values of both signs, a 16-element block of +0 (block 1), a
    block of tiny values (block 3: its NVFP4 scale byte underflows), single +0 and -0 elements."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=g) * 2
    x[:, 16:32] = 0.0
    x[:, 48:64] *= 1e-7
    x[:, 5], x[:, 40] = 0.0, -0.0
    return x.to(torch.bfloat16)


def _nibbles(q):
    return torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], -1)


NVFP4_TYPICAL = 300.0  # a global scale whose blocks' scale bytes are normal E4M3 values


@pytest.mark.parametrize("gs", [0.0, -0.0, -NVFP4_TYPICAL, math.nan, math.inf, -math.inf, 2.0 ** -149, 3e38])
def test_nvfp4_rule_for_special_global_scales(gs):
    x = _norm_rows()
    T, Hx = x.shape
    q, sb = ref.nvfp4_ref(x, gs)
    sf8 = ref.unswizzle(sb, T, Hx).reshape(T, Hx // 16)
    nib = _nibbles(q)
    xf = x.float()
    zero, neg = xf == 0, torch.signbit(xf)
    signed_zero = torch.where(neg, 8, 0).to(torch.uint8)
    signed_six = torch.where(neg, 0xF, 0x7).to(torch.uint8)
    zero_block, tiny_block = torch.zeros(T, Hx // 16, dtype=torch.bool), torch.zeros(T, Hx // 16, dtype=torch.bool)
    zero_block[:, 1], tiny_block[:, 3] = True, True
    normal_block = ~zero_block & ~tiny_block
    if gs == 0.0 and not math.copysign(1, gs) < 0 or gs == 2.0 ** -149:
        assert (sf8 == 0).all() and torch.equal(nib, signed_zero)  # the scale byte underflows: +-0
    elif gs == 0.0:  # -0: byte 0x80 (-0), its scale 1 / (-0 / -0) is NaN, so is every product: nibble 0
        assert (sf8 == 0x80).all() and (nib == 0).all()
    elif math.isnan(gs):
        assert (sf8 == 0x7F).all() and (nib == 0).all()
    elif math.isinf(gs) or gs == 3e38:
        # the scale saturates at +-448 (0x7E, 0xFE); its reciprocal is huge: every element saturates
        # (+-6), a zero is 0 * inf = NaN (nibble 0); a block of zeros: inf * 0 = NaN, byte 0x7F for an
        # infinite scale, 0 for the finite one (and then +-0 nibbles)
        want_byte = 0x7E if gs > 0 else 0xFE
        assert (sf8[~zero_block] == want_byte).all()
        if math.isinf(gs):
            assert (sf8[zero_block] == 0x7F).all() and (nib[zero] == 0).all()
        else:
            assert (sf8[zero_block] == 0).all()
            assert torch.equal(nib[:, 16:32], signed_zero[:, 16:32])
        assert torch.equal(nib[~zero], signed_six[~zero])  # the tiny block too
    else:  # negative: the bytes of |gs| with the sign bit set and the same nibbles, where they are not 0
        qp, sbp = ref.nvfp4_ref(x, -gs)
        sf8p = ref.unswizzle(sbp, T, Hx).reshape(T, Hx // 16)
        assert (sf8p[normal_block] != 0).all() and (sf8p[zero_block | tiny_block] == 0).all()
        assert torch.equal(sf8[normal_block], sf8p[normal_block] | 0x80)
        # where |gs|'s byte is 0, gs's is 0x80 (-0), whose scale is 1 / (-0 / gs) = +inf: +-6 for a
        # nonzero element, NaN (nibble 0) for a zero
        assert (sf8[zero_block | tiny_block] == 0x80).all()
        assert (nib[:, 16:32] == 0).all() and torch.equal(nib[:, 48:64], signed_six[:, 48:64])
        assert torch.equal(nib[:, :16], _nibbles(qp)[:, :16]) and torch.equal(nib[:, 32:48], _nibbles(qp)[:, 32:48])


FP8_TYPICAL = 2.0 ** -6


@pytest.mark.parametrize("s", [0.0, -0.0, -FP8_TYPICAL, math.nan, math.inf, -math.inf, 2.0 ** -149, 3e38])
def test_fp8_tensor_rule_for_special_scales(s):
    x = _norm_rows()
    b = ref.fp8_tensor_ref(x, s).view(torch.uint8)
    xf = x.float()
    zero, neg = xf == 0, torch.signbit(xf)
    flip = math.copysign(1.0, s) < 0  # a negative scale (or -0, -inf) flips every sign
    sat = torch.where(neg ^ flip, 0xFE, 0x7E).to(torch.uint8)
    signed_zero = torch.where(neg ^ flip, 0x80, 0x00).to(torch.uint8)
    if math.isnan(s):
        assert (b == 0x7F).all()
    elif s == 0.0:  # x / 0 = +-inf -> +-448; 0 / 0 = NaN -> 0x7F
        assert torch.equal(b[~zero], sat[~zero]) and (b[zero] == 0x7F).all()
    elif math.isinf(s) or s == 3e38:  # x / s -> +-0
        assert torch.equal(b, signed_zero)
    elif s == 2.0 ** -149:  # x / s overflows -> +-448; 0 / s = +-0
        assert torch.equal(b[~zero], sat[~zero]) and torch.equal(b[zero], signed_zero[zero])
    else:  # negative: the bytes of |s| with the sign bit flipped
        assert torch.equal(b, ref.fp8_tensor_ref(x, -s).view(torch.uint8) ^ 0x80)


def test_e4m3_convert_saturates_both_ways_and_writes_one_nan():
    v = torch.tensor([math.inf, -math.inf, 500.0, -500.0, -448.0, math.nan, -math.nan, -0.0, 0.0])
    got = ref.e4m3_satfinite_bytes(v).tolist()
    assert got == [0x7E, 0xFE, 0x7E, 0xFE, 0xFE, 0x7F, 0x7F, 0x80, 0x00]


@pytest.mark.parametrize("name,quant", [("global_scale", None), ("global_scale", "fp8_tensor"),
                                        ("fp8_scale", "nvfp4"), ("fp8_scale", None)])
def test_the_fake_refuses_an_unused_scale(name, quant):
    """The op's fake (meta) implementation, what torch.compile traces, refuses as the call does."""
    import dispatch
    ws = _StubWorkspace("meta")
    a = _call(quant)
    kw = {k: a[k].to("meta") for k in ("allreduce_in", "expanded_idx_to_permuted_idx", "residual_in",
                                         "norm_weight")}
    scales = {k: torch.ones(1, device="meta") for k in ("global_scale", "fp8_scale")
              if k == name or a.get(k) is not None}
    with pytest.raises(ValueError, match=rf"^{name}: given with quant={quant!r}"):
        dispatch.moe_finalize_allreduce_op(dispatch.workspace_handle(ws), **kw, quant=quant, **scales)
