"""World size 1's latency and streaming programs built for one call shape (dispatch/shape_constants.py):
the defines they take, the switch that turns them on, where the launcher uses them, and the builds
themselves (NVRTC, no GPU): they
compile for both targets without spilling, in fewer instructions than the program without them.
Their outputs against the float64 reference and the plain program's bits: tests/test_gpu_world_one.py."""
from __future__ import annotations

import re

import pytest

from dispatch import registry, shape_constants
from generator import nvrtc_build

ROW = dict(hidden=7168, top_k=8, scale_kind=1, vec_per_thread=2, threads=448)


@pytest.mark.parametrize("name,value", [("hidden", 8), ("hidden", 1 << 15), ("hidden", 7168.0), ("top_k", 0),
                                        ("top_k", 17), ("vec_per_thread", 5), ("threads", 16), ("threads", True),
                                        ("scale_kind", 3), ("scale_kind", 1.0), ("min_blocks", 0),
                                        ("min_blocks", 33), ("min_blocks", 1.0), ("min_blocks", True),
                                        ("register_cap", 31), ("register_cap", 256), ("register_cap", 64.0),
                                        ("register_cap", True)])
def test_defines_refuse_a_bad_value_by_name(name, value):
    with pytest.raises(ValueError, match=f"^{name}: "):
        shape_constants.defines(**dict(ROW, **{name: value}))


@pytest.mark.parametrize("row", [dict(ROW, hidden=7176), dict(ROW, threads=432), dict(ROW, threads=224)])
def test_defines_refuse_a_split_that_does_not_hold_the_row(row):
    with pytest.raises(ValueError, match=r"^(hidden|threads): "):
        shape_constants.defines(**row)


def test_defines_name_every_constant_once():
    text = shape_constants.defines(**ROW)
    assert text.splitlines() == ["#define MOE_AR_FIXED_HIDDEN 7168", "#define MOE_AR_FIXED_TOP_K 8",
                                 "#define MOE_AR_FIXED_SCALE_KIND 1", "#define MOE_AR_FIXED_VEC_PER_THREAD 2",
                                 "#define MOE_AR_FIXED_ROW_THREADS 448",
                                 f"#define MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS {shape_constants.MAX_TOKENS}"]


def test_a_build_names_the_fewest_blocks_a_multiprocessor_in_the_define_the_programs_read():
    from generator import spec
    text = shape_constants.defines(2048, 8, 1, 2, 128, min_blocks=1)
    assert text == shape_constants.defines(2048, 8, 1, 2, 128) + "#define MOE_AR_FIXED_MIN_BLOCKS 1\n"
    assert shape_constants.ONE_BLOCK_MIN_BLOCKS_DEFINE == spec.ONE_BLOCK_MIN_BLOCKS_DEFINE
    program = (registry.program_set().dir / "programs" / "moe_ar_local_bf16_ws1_plain.cu").read_text()
    assert f"#ifdef {spec.ONE_BLOCK_MIN_BLOCKS_DEFINE}\n" in program


@pytest.mark.parametrize("vec_per_thread,threads,T,blocks", [
    (2, 128, 1, 1), (2, 128, 128, 1), (2, 64, 48, 1), (2, 32, 100, 1), (2, 128, 129, None), (2, 64, 256, None),
    (2, 160, 64, None), (2, 256, 64, None), (2, 512, 64, None), (1, 128, 64, None), (4, 128, 64, None),
    (1, 1024, 1, None)])
def test_the_one_block_bound_is_named_for_rows_of_four_warps_at_most_up_to_128_tokens(vec_per_thread, threads,
                                                                                      T, blocks):
    """Rows of 2 vectors a thread and 4 warps or fewer (H 2048 and below), calls of up to 128 tokens
    only: at 8 warps and more, and at 256 tokens, the bound measured slower
    (bench_results/world_size_1/load_order/)."""
    assert shape_constants.ONE_BLOCK_MIN_BLOCKS_MAX_TOKENS == 128 <= shape_constants.MAX_TOKENS
    assert shape_constants.one_block_min_blocks(vec_per_thread, threads, T) == blocks


@pytest.mark.parametrize("value,on", [(None, True), ("", True), ("0", False), ("1", True)])
def test_the_switch_is_on_unless_set_to_zero(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv(shape_constants.ENV, raising=False)
    else:
        monkeypatch.setenv(shape_constants.ENV, value)
    assert shape_constants.enabled() is on


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_a_bad_switch_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv(shape_constants.ENV, value)
    with pytest.raises(ValueError, match=f"^{shape_constants.ENV}: "):
        shape_constants.enabled()


def _build(name: str, prefix: str, target: str):
    """(ptxas entry stats by function, SASS instructions by function or None without the tools)."""
    ps = registry.program_set()
    cubin, log = registry.compile_cubin(prefix + registry._manifest.source_for(ps.manifest, ps.dir, name), name,
                                        target)
    log = log.decode("utf-8", "replace") if isinstance(log, bytes) else log
    stats = {s.function: s for s in nvrtc_build.parse_ptxas_log(log)}
    from moe_ar_tools import sass_diff
    try:
        tools = sass_diff.find_tools()
    except Exception:  # noqa: BLE001 - cuobjdump and nvdisasm come with the test extra
        return stats, None
    functions = re.split(r"\n\s*Function : ", sass_diff.disassemble(cubin, tools))[1:]
    return stats, {f.split()[0]: sum(1 for line in f.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
                   for f in functions}


def _need_nvrtc():
    """Skip where CuPy or NVRTC is missing (the test extra brings both)."""
    pytest.importorskip("cupy")
    from moe_ar_common import cuda_env
    try:
        cuda_env.load_nvrtc()
    except cuda_env.MissingToolchain as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("profile", ["plain", "nvfp4", "fp8_group128", "fp8_tensor"])
def test_shape_builds_compile_without_spills_in_fewer_instructions(profile):
    _need_nvrtc()
    name = f"moe_ar_local_bf16_ws1_{profile}"
    entry = registry.program_set().by_name[name]
    symbols = {entry["symbol"], entry["cluster_symbol"]}
    _, plain_counts = _build(name, "", "sm_90a")
    rows = [(ROW, "sm_90a"), (dict(hidden=4096, top_k=2, scale_kind=0, vec_per_thread=2, threads=256), "sm_90a"),
            (dict(hidden=2064, top_k=5, scale_kind=2, vec_per_thread=2, threads=160), "sm_90a")]
    rows.append((dict(hidden=7168, top_k=8, scale_kind=1, vec_per_thread=1, threads=1024), "sm_90a"))  # the cluster's
    # the one-block build of small rows, one block a multiprocessor at least (128 registers at most)
    rows.append((dict(hidden=2048, top_k=8, scale_kind=1, vec_per_thread=2, threads=128, min_blocks=1), "sm_90a"))
    if profile == "plain":
        rows.append((ROW, "sm_100a"))
    for row, target in rows:
        stats, counts = _build(name, shape_constants.defines(**row), target)
        assert set(stats) == symbols, (row, target, stats)
        for s in stats.values():
            assert s.spill_store_bytes == 0 and s.spill_load_bytes == 0 and s.registers <= 128, (row, target, s)
        if counts is not None and plain_counts is not None and target == "sm_90a":
            for symbol in symbols:
                assert counts[symbol] < plain_counts[symbol], (row, symbol, counts[symbol], plain_counts[symbol])


@pytest.mark.parametrize("profile", ["plain", "nvfp4"])
def test_the_one_block_bound_changes_registers_and_order_not_arithmetic(profile):
    """The build bound to one block a multiprocessor (H 2048) gets more registers, no spills, and the
    same arithmetic as the build without the bound: as many of each floating-point and conversion
    instruction (ptxas fuses no other multiply-add), the same loads and stores."""
    from moe_ar_tools import sass_diff
    _need_nvrtc()
    try:
        tools = sass_diff.find_tools()
    except Exception as e:  # noqa: BLE001 - cuobjdump and nvdisasm come with the test extra
        pytest.skip(str(e))
    name = f"moe_ar_local_bf16_ws1_{profile}"
    ps = registry.program_set()
    source = registry._manifest.source_for(ps.manifest, ps.dir, name)
    got = []
    for blocks in (None, 1):
        cubin, log = registry.compile_cubin(shape_constants.defines(2048, 8, 1, 2, 128, blocks) + source, name,
                                            "sm_90a")
        log = log.decode("utf-8", "replace") if isinstance(log, bytes) else log
        stats = {s.function: s for s in nvrtc_build.parse_ptxas_log(log)}[name]
        assert stats.spill_store_bytes == 0 and stats.spill_load_bytes == 0, (blocks, stats)
        body = next(f for f in re.split(r"\n\s*Function : ", sass_diff.disassemble(cubin, tools))[1:]
                    if f.split("\n", 1)[0].strip() == name)
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", body)
        kinds = ("FFMA", "FADD", "FMUL", "MUFU", "F2FP", "F2F", "HADD2", "LDG", "STG")
        got.append((stats.registers, {k: ops.count(k) for k in kinds}))
    (plain_regs, plain_ops), (bound_regs, bound_ops) = got
    assert bound_regs > plain_regs and bound_regs <= 128, got
    assert bound_ops == plain_ops and plain_ops["FFMA"] > 0, got


@pytest.mark.parametrize("profile", shape_constants.STREAMING_PROFILES)
def test_streaming_builds_compile_without_spills_in_fewer_instructions(profile):
    from dispatch.workspace_sizes import row_split
    _need_nvrtc()
    name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
    symbol = registry.program_set().by_name[name]["symbol"]
    _, plain_counts = _build(name, "", "sm_90a")
    for hidden, scale_kind in ((7168, 1), (4096, 0), (2048, 2)):
        split = row_split(hidden // 8, 4, 1 << 30)  # the streaming layout's wide split
        stats, counts = _build(name, shape_constants.defines(hidden, 8, scale_kind, split.vec_per_thread,
                                                             split.threads), "sm_90a")
        s = stats[symbol]
        assert s.spill_store_bytes == 0 and s.spill_load_bytes == 0 and s.registers <= 128, (hidden, s)
        if counts is not None and plain_counts is not None:
            assert counts[symbol] < plain_counts[symbol], (hidden, counts[symbol], plain_counts[symbol])


class _FakeProgram:
    """What a launcher reads of a loaded program: two kernels and its occupancy."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.function_ptr, self.cluster_function_ptr = 1000 + len(prefix), 2000 + len(prefix)

    def max_blocks_per_sm(self, threads, dynamic_smem=0):
        return 3 if self.prefix else 1


def _launcher(regime, splits, on, monkeypatch, loads, profile="plain", hidden=7168, fixed_split=False):
    """A real launcher._Launcher's kernel_call without a GPU (fields as __init__ sets them);
    `fixed_split`: the workspace fixes vec_per_thread."""
    import types
    import torch
    from dispatch import launcher
    from dispatch.workspace_sizes import cluster_layout_split, row_split
    monkeypatch.setattr(registry, "load", lambda name, device, prefix="": loads.append((name, prefix)) or
                        _FakeProgram(prefix))
    lau = object.__new__(launcher._Launcher)
    family = "local" if regime == registry.LOCAL_LATENCY_REGIME else "local_streaming"
    lau.name, lau.regime, lau.profile, lau.device_index = f"moe_ar_{family}_bf16_ws1_{profile}", regime, profile, 0
    lau.template = registry.params_struct()()
    lau.row_splits = tuple(row_split(hidden // 8, vpt, top) for vpt, top in splits)
    lau.threads = [s.threads for s in lau.row_splits]
    lau.max_blocks, lau.dynamic_smem, lau.sms, lau.sharing = [32] * len(splits), 0, 132, 1
    lau.cluster_max_tokens, lau.cluster_max_tokens_by_top_k, lau.cluster_blocks = 0, (0,) * 9, 1
    lau.cluster_split = cluster_layout_split(hidden // 8, 1, 0)
    lau.function_ptr, lau.cluster_function_ptr = 1, 2
    lau.sliced_units = lau.column_units = False
    if on:
        monkeypatch.delenv(shape_constants.ENV, raising=False)  # the default
    else:
        monkeypatch.setenv(shape_constants.ENV, "0")
    lau.shape_builds = ({} if shape_constants.applies(regime, lau.row_splits, profile, hidden)
                        else None)  # as __init__ sets it
    lau.few_routes_split = (row_split(hidden // 8, shape_constants.FEW_ROUTES_VEC_PER_THREAD, 1 << 30)
                            if lau.shape_builds is not None and not fixed_split
                            and shape_constants.few_routes(regime, profile, hidden) else None)
    ws = types.SimpleNamespace(hidden=hidden, world_size=1,
                               _moe_ar_state=types.SimpleNamespace(fault_stop_after_units=0))

    def call(T, top_k, scale):
        a = dict(expert_scale_factor=scale, fp8_scale_layout="row", fp8_pow2_scales=False,
                 expanded_idx_to_permuted_idx=torch.empty(T, top_k, dtype=torch.int32),
                 allreduce_in=torch.empty(T * top_k, 8), routed_scaling_factor=1.0, eps=1e-6, weight_bias=0,
                 launch_with_pdl=False)
        return lau.kernel_call(ws, T, a, ("allreduce_in", "expanded_idx_to_permuted_idx"))
    call.launcher = lau
    return call


def test_the_launcher_builds_once_per_top_k_and_weight_kind(monkeypatch):
    import torch
    loads = []
    call = _launcher(registry.LOCAL_LATENCY_REGIME, [(2, 1 << 30)], True, monkeypatch, loads)
    fp32 = torch.empty(1, dtype=torch.float32)
    first = call(300, 8, fp32)
    assert loads == [("moe_ar_local_bf16_ws1_plain", shape_constants.defines(7168, 8, 1, 2, 448))]
    assert first.function_ptr == 1000 + len(loads[0][1])
    # the build's own occupancy (3 blocks a multiprocessor here) against the program's grid of 32
    assert first.config.gridDimX == 300
    # the builds serve up to 1,024 tokens (bench_results/world_size_1/few_routes_group/)
    assert shape_constants.MAX_TOKENS == 1024
    assert call(1024, 8, fp32).function_ptr == first.function_ptr
    call(5, 8, fp32)
    assert len(loads) == 1  # the same top_k and weight kind: the same build
    call(5, 2, None)
    call(5, 8, torch.empty(1, dtype=torch.bfloat16))
    assert [prefix for _, prefix in loads[1:]] == [shape_constants.defines(7168, 2, 0, 2, 448),
                                                    shape_constants.defines(7168, 8, 2, 2, 448)]
    above = call(shape_constants.MAX_TOKENS + 1, 8, fp32)  # past the builds' range: the program itself
    assert len(loads) == 3 and above.function_ptr == 1 and above.config.gridDimX == 32


def test_the_cluster_layout_builds_for_its_own_split(monkeypatch):
    """A cluster call (few tokens) runs the cluster kernel of a build for the cluster layout's split
    (one vector a thread, 1,024 threads at H 7168), one build per top_k and weight kind beside the
    one-block layout's; above cluster_max_tokens the one-block build."""
    import torch
    from dispatch import launcher
    from dispatch.workspace_sizes import cluster_layout_split
    loads = []
    call = _launcher(registry.LOCAL_LATENCY_REGIME, [(2, 1 << 30)], True, monkeypatch, loads)
    lau = call.launcher
    most = registry.program_set().limits["cluster_max_tokens"]
    lau.cluster_blocks, lau.cluster_max_tokens, lau.cluster_max_tokens_by_top_k = 8, most, (most,) * 9
    lau.cluster_split = cluster_layout_split(7168 // 8, 8, most)
    lau.cluster_attrs = (launcher._cluster_attributes(8, False), launcher._cluster_attributes(8, True))
    fp32 = torch.empty(1, dtype=torch.float32)
    few = call(5, 8, fp32)
    cluster_prefix = shape_constants.defines(7168, 8, 1, 1, 1024)
    assert loads == [("moe_ar_local_bf16_ws1_plain", cluster_prefix)]
    assert few.function_ptr == 2000 + len(cluster_prefix)  # the build's cluster kernel
    assert (few.params.vec_per_thread, few.config.gridDimX, few.config.blockDimX) == (1, 5 * 8, 128)
    call(most, 8, fp32)
    assert len(loads) == 1
    more = call(most + 1, 8, fp32)
    block_prefix = shape_constants.defines(7168, 8, 1, 2, 448)
    assert loads[1:] == [("moe_ar_local_bf16_ws1_plain", block_prefix)]
    assert more.function_ptr == 1000 + len(block_prefix) and more.params.vec_per_thread == 2
    assert more.config.blockDimX == 448


@pytest.mark.parametrize("hidden,one_block_blocks", [(2048, 1), (1024, 1), (4096, None), (7168, None)])
def test_the_one_block_build_of_small_rows_names_one_block_a_multiprocessor(hidden, one_block_blocks, monkeypatch):
    """The latency program's one-block build at rows of 4 warps or fewer defines MOE_AR_FIXED_MIN_BLOCKS 1
    for calls of up to 128 tokens, beside a build without it for 129-256; its cluster build and larger
    rows' builds do not."""
    import torch
    from dispatch import launcher
    from dispatch.workspace_sizes import cluster_layout_split
    loads = []
    call = _launcher(registry.LOCAL_LATENCY_REGIME, [(2, 1 << 30)], True, monkeypatch, loads, hidden=hidden)
    lau = call.launcher
    lau.cluster_blocks, lau.cluster_max_tokens, lau.cluster_max_tokens_by_top_k = 4, 16, (16,) * 9
    lau.cluster_split = cluster_layout_split(hidden // 8, 4, 16)
    lau.cluster_attrs = (launcher._cluster_attributes(4, False), launcher._cluster_attributes(4, True))
    fp32 = torch.empty(1, dtype=torch.float32)
    cluster, bound = call(16, 8, fp32), call(17, 8, fp32)
    assert call(128, 8, fp32).function_ptr == bound.function_ptr and len(loads) == 2  # the same build
    above = call(129, 8, fp32)  # past ONE_BLOCK_MIN_BLOCKS_MAX_TOKENS: a build without the bound
    assert call(256, 8, fp32).function_ptr == above.function_ptr
    split = lau.row_splits[0]
    assert split.vec_per_thread == 2 and split.threads == hidden // 16
    program = "moe_ar_local_bf16_ws1_plain"
    want = [(program, shape_constants.defines(hidden, 8, 1, 1, lau.cluster_split.threads)),
            (program, shape_constants.defines(hidden, 8, 1, 2, hidden // 16, one_block_blocks))]
    if one_block_blocks:
        want.append((program, shape_constants.defines(hidden, 8, 1, 2, hidden // 16)))
    assert loads == want
    assert cluster.function_ptr == 2000 + len(want[0][1]) and bound.function_ptr == 1000 + len(want[1][1])
    assert above.function_ptr == 1000 + len(want[-1][1])


@pytest.mark.parametrize("regime,splits,on,profile,top_k", [
    (registry.LOCAL_LATENCY_REGIME, [(2, 1 << 30)], False, "plain", 8),
    (registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], False, "plain", 8),
    (registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], True, "plain", 2),  # top_k 8 only
    (registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], True, "fp8_group128", 8),
    (registry.LOCAL_LATENCY_REGIME, [(2, 256), (4, 1 << 30)], True, "plain", 8)])
def test_no_build_where_it_is_off_or_does_not_apply(regime, splits, on, profile, top_k, monkeypatch):
    loads = []
    call = _launcher(regime, splits, on, monkeypatch, loads, profile)
    k = call(40, top_k, None)
    assert loads == [] and k.function_ptr == 1 and k.config.gridDimX == 32


@pytest.mark.parametrize("profile,hidden", [(p, h) for p in shape_constants.STREAMING_PROFILES
                                             for h in (7168, 4096, 2048)
                                             if h <= shape_constants.STREAMING_MAX_HIDDEN[p]])
def test_the_streaming_program_builds_at_top_k_8_at_every_t(profile, hidden, monkeypatch):
    """The streaming program's builds serve every T of top_k 8 (no MAX_TOKENS), one per weight kind."""
    import torch
    from dispatch.workspace_sizes import row_split
    loads = []
    call = _launcher(registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], True, monkeypatch, loads, profile, hidden)
    threads = row_split(hidden // 8, 4, 1 << 30).threads
    for T in (1, shape_constants.MAX_TOKENS + 1, 1 << 16):
        k = call(T, 8, None)
        assert k.function_ptr == 1000 + len(shape_constants.defines(hidden, 8, 0, 4, threads)), T
    assert loads == [(f"moe_ar_local_streaming_bf16_ws1_{profile}", shape_constants.defines(hidden, 8, 0, 4, threads))]
    call(300, 8, torch.empty(1, dtype=torch.float32))
    assert [prefix for _, prefix in loads[1:]] == [shape_constants.defines(hidden, 8, 1, 4, threads)]
    assert call(300, 4, None).function_ptr == 1 and len(loads) == 2
    # a build's key (top_k, weight kind, one-block bound), as the GPU tests read it: never bound here
    assert set(call.launcher.shape_builds) == {(8, 0, None), (8, 1, None)}


def test_the_streaming_builds_end_at_each_profiles_largest_hidden_size(monkeypatch):
    """A profile's streaming program builds at rows up to STREAMING_MAX_HIDDEN[profile] elements and
    runs the program above (FP8 group-128's build is slower than its program at H 7168)."""
    assert all(shape_constants.STREAMING_MAX_HIDDEN[p] >= 1 << 14 for p in ("plain", "nvfp4", "fp8_tensor"))
    assert shape_constants.STREAMING_MAX_HIDDEN["fp8_group128"] < 7168
    for profile, most in shape_constants.STREAMING_MAX_HIDDEN.items():
        for hidden in (2048, 4096, 5120, 7168):
            loads = []
            call = _launcher(registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], True, monkeypatch, loads,
                             profile, hidden)
            k = call(300, 8, None)
            builds = hidden <= most
            assert (k.function_ptr != 1) == builds and len(loads) == builds, (profile, hidden)


def test_a_build_names_its_register_cap_in_the_define_the_streaming_programs_read():
    from generator import spec
    text = shape_constants.defines(4096, 2, 1, 2, 256, register_cap=64)
    assert text == shape_constants.defines(4096, 2, 1, 2, 256) + "#define MOE_AR_FIXED_REGISTER_CAP 64\n"
    assert shape_constants.REGISTER_CAP_DEFINE == spec.STREAMING_CAP_DEFINE
    for profile in shape_constants.STREAMING_PROFILES:
        program = (registry.program_set().dir / "programs" /
                   f"moe_ar_local_streaming_bf16_ws1_{profile}.cu").read_text()
        assert f"#ifdef {spec.STREAMING_CAP_DEFINE}\n" in program
        assert f"__maxnreg__({spec.LOCAL_TWO_BLOCKS_CAP})" in program  # without the define: two blocks


@pytest.mark.parametrize("profile,hidden", [(p, h) for p in ("plain", "nvfp4", "fp8_tensor", "fp8_group128")
                                             for h in (4096, 2048, 1024)])
def test_calls_of_few_routes_run_the_streaming_build_of_their_own_split(profile, hidden, monkeypatch):
    """At H <= 4096, a call of top_k 1 or 2 runs the streaming build of 2 vectors a thread under 64
    registers (twice the threads a block of the program's split), one per top_k and weight kind, at
    every T; top_k 8 keeps the program's split."""
    from dispatch.workspace_sizes import row_split
    loads = []
    call = _launcher(registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], True, monkeypatch, loads, profile, hidden)
    wide, few = row_split(hidden // 8, 4, 1 << 30), row_split(hidden // 8, 2, 1 << 30)
    assert few.threads == 2 * wide.threads and few.vec_per_thread == 2
    want = shape_constants.defines(hidden, 2, 0, 2, few.threads, register_cap=64)
    for T in (1, 300, 1 << 16):
        k = call(T, 2, None)
        assert k.function_ptr == 1000 + len(want) and k.config.blockDimX == few.threads, T
        assert k.params.vec_per_thread == 2 and k.config.gridDimX == min(T, 3 * 132), T
    one = call(300, 1, None)
    assert one.config.blockDimX == few.threads and one.params.vec_per_thread == 2
    eight = call(300, 8, None)
    assert eight.config.blockDimX == wide.threads and eight.params.vec_per_thread == 4
    assert loads == [(f"moe_ar_local_streaming_bf16_ws1_{profile}", prefix) for prefix in (
        want, shape_constants.defines(hidden, 1, 0, 2, few.threads, register_cap=64),
        shape_constants.defines(hidden, 8, 0, 4, wide.threads))]
    assert set(call.launcher.shape_builds) == {(2, 0, None), (1, 0, None), (8, 0, None)}
    # what dispatch.select_program asks of this launcher (its latency range ends at 256 tokens for these)
    assert [call.launcher.takes_few_routes(k) for k in (1, 2, 3, 8)] == [True, True, False, False]


@pytest.mark.parametrize("profile,hidden,fixed_split", [
    ("plain", 7168, False), ("plain", 6144, False), ("fp8_group128", 5120, False), ("plain", 4096, True),
    ("fp8_group128", 4096, True)])
def test_no_few_routes_build_above_h_4096_or_for_a_fixed_split(profile, hidden, fixed_split, monkeypatch):
    """Rows above H 4096 and a workspace that fixes vec_per_thread (every layout keeps it) run top_k 2
    on the program's own split."""
    loads = []
    call = _launcher(registry.LOCAL_STREAMING_REGIME, [(4, 1 << 30)], True, monkeypatch, loads, profile, hidden,
                     fixed_split)
    k = call(300, 2, None)
    assert loads == [] and k.function_ptr == 1 and k.params.vec_per_thread == 4
    assert k.config.blockDimX == call.launcher.threads[0]
    assert not call.launcher.takes_few_routes(2) and not call.launcher.takes_few_routes(1)


@pytest.mark.parametrize("profile", shape_constants.FEW_ROUTES_PROFILES)
def test_few_routes_builds_compile_under_their_cap_without_spills(profile):
    """The few-routes builds (2 vectors a thread, cap 64) for H 4096, 2048 and 1024, top_k 1 and 2, every
    weight kind: 64 registers or fewer, no spill, for both targets."""
    from dispatch.workspace_sizes import row_split
    _need_nvrtc()
    name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
    symbol = registry.program_set().by_name[name]["symbol"]
    for hidden, top_k, scale_kind in ((4096, 2, 1), (4096, 1, 0), (2048, 2, 2), (1024, 2, 1)):
        split = row_split(hidden // 8, shape_constants.FEW_ROUTES_VEC_PER_THREAD, 1 << 30)
        prefix = shape_constants.defines(hidden, top_k, scale_kind, split.vec_per_thread, split.threads,
                                         register_cap=shape_constants.FEW_ROUTES_REGISTER_CAP)
        for target in ("sm_90a", "sm_100a"):
            stats, _ = _build(name, prefix, target)
            s = stats[symbol]
            assert s.spill_store_bytes == 0 and s.spill_load_bytes == 0, (hidden, top_k, target, s)
            assert s.registers <= shape_constants.FEW_ROUTES_REGISTER_CAP, (hidden, top_k, target, s)
