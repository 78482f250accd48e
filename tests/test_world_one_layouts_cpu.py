"""World size 1's layouts as the generator writes them and the launcher picks them, without a GPU:
the cluster layout (a second kernel of the latency programs, launched with a cluster of blocks a
token up to the manifest's cluster_max_tokens) and the streaming program's form (two blocks a
multiprocessor with register loads). The GPU tests
(tests/test_gpu_world_one.py) check what they compute; bench_results/world_size_1/cluster/ and
two_blocks/ what they cost."""
from __future__ import annotations

import ctypes
import json
import pathlib

import pytest

from dispatch import launcher, registry
from dispatch.registry import LOCAL_STREAMING_REGIME
from dispatch.workspace_sizes import cluster_layout_split, cluster_row_split, row_split
from generator import abi, render, spec

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rendered():
    return render.render_all(ROOT)


@pytest.fixture(scope="module")
def manifest(rendered):
    return json.loads(rendered.outputs["manifest.json"])


def test_latency_programs_have_a_cluster_kernel_and_no_other_program_has(rendered, manifest):
    for p in manifest["programs"]:
        text = rendered.outputs[p["file"]].decode()
        if p["family"] == "local":
            assert p["cluster_symbol"] == p["symbol"] + "_cluster"
            assert f'{p["cluster_symbol"]}(const moe_ar::Params p) {{\n  moe_ar::run_local_cluster<' in text
        else:
            assert p["cluster_symbol"] is None and "_cluster(" not in text and "run_local_cluster" not in text
    limits = manifest["limits"]
    assert limits["cluster_max_tokens"] == abi.CLUSTER_MAX_TOKENS > 0
    assert 2 <= limits["cluster_max_blocks"] == abi.CLUSTER_MAX_BLOCKS <= 8  # the portable cluster size
    assert limits["cluster_min_warps"] == abi.CLUSTER_MIN_WARPS
    assert limits["cluster_round_min_warps"] == abi.CLUSTER_ROUND_MIN_WARPS
    assert 0 < limits["cluster_small_row_max_tokens"] == abi.CLUSTER_SMALL_ROW_MAX_TOKENS \
        <= limits["cluster_small_row_many_routes_max_tokens"] == abi.CLUSTER_SMALL_ROW_MANY_ROUTES_MAX_TOKENS \
        <= limits["cluster_max_tokens"]
    assert 1 <= limits["cluster_many_routes_top_k"] == abi.CLUSTER_MANY_ROUTES_TOP_K <= launcher._CLUSTER_MAX_ROUTES


@pytest.mark.parametrize("hidden, top_k, tokens", [
    (7168, 8, 48), (7168, 1, 48), (6144, 2, 48), (8192, 8, 48), (16384, 4, 48), (5120, 8, 32), (5120, 1, 16),
    (4096, 8, 32), (4096, 7, 16), (4096, 2, 16), (2048, 8, 32), (2048, 6, 16), (1024, 8, 0), (7168, 9, 0),
    (4096, 9, 0)])
def test_smaller_rows_take_the_cluster_layout_to_fewer_tokens(hidden, top_k, tokens):
    """Rows of 12 warps or more take the cluster layout up to cluster_max_tokens whatever top_k,
    smaller ones up to cluster_small_row_many_routes_max_tokens at top_k 8, up to
    cluster_small_row_max_tokens at fewer routes; rows of under 4 warps and top_k over 8 never."""
    limits = registry.program_set().limits
    nvec = hidden // 8
    split = cluster_row_split(row_split(nvec, 2, 256), nvec, limits["cluster_round_min_warps"],
                              limits["cluster_max_blocks"], limits["max_threads"])
    blocks = launcher.cluster_blocks_for("local", (split,))
    assert launcher.cluster_max_tokens_for((split,), blocks, top_k) == tokens


def test_a_small_rows_token_limit_follows_top_k():
    """A launcher of a small row (H 4096: a cluster of 8 blocks) keeps a limit per top_k: 32 tokens
    at top_k 8, 16 below."""
    la = _FakeLauncher(8, 256)
    la.row_splits = (row_split(4096 // 8, 2, 256),)
    la.cluster_max_tokens_by_top_k = tuple(launcher.cluster_max_tokens_for(la.row_splits, 8, k) for k in range(9))
    assert la.cluster_max_tokens_by_top_k == (16,) * 8 + (32,)
    assert la.uses_cluster(32, 8) and not la.uses_cluster(33, 8)
    assert la.uses_cluster(16, 2) and not la.uses_cluster(17, 2) and not la.uses_cluster(17, 7)


@pytest.mark.parametrize("hidden, blocks", [(7168, 7), (6144, 6), (8192, 8), (7680, 5), (4096, 8), (2048, 4),
                                            (5120, 5), (1024, 1), (256, 1), (16384, 8)])
def test_cluster_blocks_divide_the_rows_warps(hidden, blocks):
    """The few-tokens split's warps over the largest divisor <= 8, for rows of 4 warps or more (H 1024:
    2 warps, no cluster layout; H 256: not whole warps)."""
    split = row_split(hidden // 8, 2, 256)
    assert launcher.cluster_blocks_for("local", (split,)) == blocks
    if blocks > 1:
        assert split.threads % (32 * blocks) == 0


@pytest.mark.parametrize("hidden, threads, blocks", [(7168, 512, 8), (6144, 512, 8), (8192, 512, 8),
                                                     (16384, 1024, 8), (4096, 256, 8), (5120, 320, 5),
                                                     (2048, 128, 4)])
def test_the_latency_split_takes_whole_clusters_of_eight(hidden, threads, blocks):
    """Where the row has 12 warps or more its warps round up to a multiple of 8: a cluster of 8
    blocks (H 7168: 16 warps, not 14 over 7 blocks), the last vector places masked. Smaller rows keep
    their split and take the largest divisor of their warps (H 5120: 10 warps over 5 blocks)."""
    limits = registry.program_set().limits
    nvec = hidden // 8
    split = cluster_row_split(row_split(nvec, 2, 256), nvec, limits["cluster_round_min_warps"], limits["cluster_max_blocks"],
                              limits["max_threads"])
    assert split.threads == threads and split.max_tokens == 256
    assert split.threads * split.vec_per_thread >= nvec > split.threads * (split.vec_per_thread - 1)
    assert launcher.cluster_blocks_for("local", (split,)) == blocks


@pytest.mark.parametrize("hidden, blocks, threads", [(7168, 8, 1024), (6144, 8, 768), (8192, 8, 1024),
                                                     (7680, 5, 960), (6144, 6, 768)])
def test_the_cluster_layout_takes_one_vector_a_thread(hidden, blocks, threads):
    """The cluster layout's own split: one vector a thread, whole warps in each of the cluster's
    blocks, every vector of the row held, each block within the block limit."""
    limits = registry.program_set().limits
    nvec = hidden // 8
    split = cluster_layout_split(nvec, blocks, limits["cluster_max_tokens"])
    assert (split.threads, split.vec_per_thread, split.max_tokens) == (threads, 1, limits["cluster_max_tokens"])
    assert split.threads % (32 * blocks) == 0 and nvec <= split.threads < nvec + 32 * blocks
    assert split.threads // blocks <= limits["max_threads"]


def test_the_rounded_split_stays_under_the_block_limit_and_off_other_splits():
    wide = row_split(7168 // 8, 4, 1 << 30)
    assert cluster_row_split(wide, 896, 12, 8, 1024) == wide  # 4 vectors a thread: no cluster layout
    big = row_split(16384 // 8, 2, 256)._replace(threads=30 * 32)  # would round to 1,024 threads
    assert cluster_row_split(big, 2048, 12, 8, 960) == big


def test_world_size_one_latency_split_is_the_rounded_one():
    """The workspace hands the latency launcher the rounded split, every other regime the row split."""
    from dispatch.local import LocalWorkspace
    ws = LocalWorkspace.__new__(LocalWorkspace)
    ws.vec_per_thread, ws.hidden = None, 7168
    ws.row_splits = (row_split(896, 2, 256), row_split(896, 4, 1 << 30))
    (latency,) = ws.row_splits_for(registry.LOCAL_LATENCY_REGIME)
    assert (latency.threads, latency.vec_per_thread) == (512, 2)
    assert ws.row_splits_for(LOCAL_STREAMING_REGIME) == (ws.row_splits[1],)
    assert ws.row_splits_for("oneshot") == ws.row_splits  # the exchanges keep the row split


def test_no_cluster_outside_the_latency_layout_or_with_more_vectors_a_thread():
    few = row_split(7168 // 8, 2, 256)
    assert launcher.cluster_blocks_for(LOCAL_STREAMING_REGIME, (few,)) == 1
    assert launcher.cluster_blocks_for("oneshot", (few,)) == 1
    assert launcher.cluster_blocks_for("local", (row_split(7168 // 8, 4, 256),)) == 1  # not the all-loads row
    assert launcher.cluster_blocks_for("local", (few, row_split(7168 // 8, 4, 1 << 30))) == 1  # not one split
    odd = few._replace(threads=440)  # not whole warps (the splits round to warps: defensive)
    assert launcher.cluster_blocks_for("local", (odd,)) == 1
    assert launcher.cluster_blocks_for("local", (few._replace(threads=3 * 32),)) == 1  # under 4 warps
    prime = few._replace(threads=13 * 32)  # 13 warps: no divisor from 2 to 8
    assert launcher.cluster_blocks_for("local", (prime,)) == 1


@pytest.mark.parametrize("pdl", [False, True])
def test_cluster_launch_attributes(pdl):
    attrs = launcher._cluster_attributes(7, pdl)
    assert len(attrs) == 1 + pdl
    assert attrs[0].id == 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert list(attrs[0].value.clusterDim) == [7, 1, 1]
    if pdl:
        assert attrs[1].id == launcher._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        assert attrs[1].value.programmaticStreamSerializationAllowed == 1
    # cuda.h's CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value
    assert ctypes.sizeof(launcher._LaunchAttribute) == 72


class _FakeLauncher(launcher._Launcher):
    """A launcher with only what config_for and uses_cluster read (no GPU)."""

    def __init__(self, cluster_blocks, threads):
        self.cluster_blocks, self.threads = cluster_blocks, [threads]
        self.cluster_max_tokens = registry.program_set().limits["cluster_max_tokens"] if cluster_blocks > 1 else 0
        self.cluster_max_tokens_by_top_k = (self.cluster_max_tokens,) * 9
        self.cluster_split = cluster_layout_split(7168 // 8, cluster_blocks, self.cluster_max_tokens)
        self.cluster_attrs = (launcher._cluster_attributes(cluster_blocks, False),
                              launcher._cluster_attributes(cluster_blocks, True))
        self.row_splits = (row_split(7168 // 8, 2, 1 << 30),)
        self.sliced_units = self.column_units = False
        self.max_blocks = [132]
        self.dynamic_smem = 0


@pytest.mark.parametrize("pdl", [False, True])
def test_config_spreads_few_tokens_over_clusters(pdl):
    la = _FakeLauncher(8, 512)
    most = registry.program_set().limits["cluster_max_tokens"]
    for T in (1, 5, most):
        assert la.uses_cluster(T, 8)
        config = la.config_for(None, T, pdl, 8)
        # one vector a thread: 8 blocks of 4 warps hold the 896 vectors of H 7168
        assert (config.gridDimX, config.blockDimX, config.numAttrs) == (T * 8, 128, 1 + pdl)
        assert config.attrs[0].id == 4
    assert not la.uses_cluster(most + 1, 8) and not la.uses_cluster(1, 9)  # the all-loads row: top_k <= 8
    config = la.config_for(None, most + 1, pdl, 8)
    assert (config.gridDimX, config.blockDimX, config.numAttrs) == (most + 1, 512, int(pdl))
    plain = _FakeLauncher(1, 448)  # no cluster kernel or no divisor: never a cluster launch
    assert not plain.uses_cluster(1, 8) and plain.config_for(None, 1, pdl, 8).blockDimX == 448


def test_streaming_program_forms(manifest):
    for p in manifest["programs"]:
        if p["family"] != "local_streaming":
            continue
        assert p["row_stages"] == 0 and p["register_cap"] == spec.LOCAL_TWO_BLOCKS_CAP
        # two 224-thread blocks (H 7168, 4 vectors a thread) fit the register file under the cap
        assert 2 * 224 * spec.LOCAL_TWO_BLOCKS_CAP <= abi.REGISTERS_PER_SM
