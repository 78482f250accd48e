"""Workspace sizes the kernel's 32-bit counts can hold (dispatch.workspace_sizes.check_sizes), without a GPU.

The kernel keeps a buffer's extent in 16-byte vectors in a 32-bit state word, and products of the
token count with small factors (vectors a thread, top_k, FP8 scale groups) in 32-bit ints; a
workspace whose sizes could overflow one of them is refused when it is made, with a ValueError
naming the argument."""
import pytest
import torch

from dispatch import gpu_facts, table_sets, workspace
from dispatch.workspace_sizes import MAX_BUFFER_VECTORS, MAX_HIDDEN, MAX_TOKENS, buffer_elems_for, check_sizes

INT32_MAX = 2 ** 31 - 1
UINT32_MAX = 2 ** 32 - 1
MAX_TOP_K, MAX_VEC_PER_THREAD, MAX_THREADS = 16, 4, 512


def test_the_bounds_keep_the_kernels_32_bit_counts_in_range():
    T, H = MAX_TOKENS, MAX_HIDDEN
    nvec = H // 8
    # FP8-group column-major scale offset from the row's scale, an int: group * roundup(T, 4)
    assert (H // 128 - 1) * (-(-T // 4) * 4) <= INT32_MAX
    # work units (a row slice each) and grid-stride loop counters past them (the grid is at most the units)
    assert 2 * T * MAX_VEC_PER_THREAD <= INT32_MAX
    # the NVFP4 scale padding loop: 3 padding columns a row, plus a stride of grid * block
    assert 3 * T + 32 * 1024 * MAX_THREADS <= INT32_MAX
    # skipped-route loads a thread counts (unsigned), in every family: vectors a thread x routes x rows
    assert (T + 1) * MAX_VEC_PER_THREAD * MAX_TOP_K <= UINT32_MAX
    # the row ring's rows a block (unsigned): two units a column, each up to top_k + shared + residual rows
    assert (T + 1) * (MAX_TOP_K + 2) <= UINT32_MAX
    # a buffer's extent in vectors: what the 32-bit state word holds
    assert MAX_BUFFER_VECTORS == UINT32_MAX
    assert nvec * 8 == H


@pytest.mark.parametrize("world_size,max_tokens,hidden,oneshot_max_tokens", [
    (2, MAX_TOKENS, 16, 1024),           # the most tokens
    (8, MAX_TOKENS, 16, 1024),
    (2, 1024, MAX_HIDDEN, 1024),         # the widest rows
    (2, 131072, 16384, 1024),            # issue 24: a buffer of 2^32 elements (its extent overflowed a 32-bit count)
    (2, 2 ** 20 - 1, 16384, 1024),       # the largest buffer at world size 2, hidden 16384
    (8, 262143, 16384, 262143),          # the largest one-shot buffer at world size 8, hidden 16384
])
def test_check_sizes_accepts_the_largest_safe_sizes(world_size, max_tokens, hidden, oneshot_max_tokens):
    check_sizes(world_size, max_tokens, hidden, oneshot_max_tokens)
    elems = buffer_elems_for(world_size, max_tokens, hidden, oneshot_max_tokens)
    assert elems // 8 <= UINT32_MAX and elems % 8 == 0


@pytest.mark.parametrize("world_size,max_tokens,hidden,oneshot_max_tokens,name", [
    (2, MAX_TOKENS + 1, 16, 1024, "max_tokens"),
    (2, 1024, MAX_HIDDEN + 16, 1024, "hidden"),
    (2, 2 ** 20, 16384, 1024, "max_tokens"),             # 2^32 vectors a buffer
    (4, 2 ** 20, 16384, 1024, "max_tokens"),
    (8, 262144, 16384, 262144, "oneshot_max_tokens"),    # the one-shot layout is the larger one
])
def test_check_sizes_refuses_just_past_each_bound(world_size, max_tokens, hidden, oneshot_max_tokens, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        check_sizes(world_size, max_tokens, hidden, oneshot_max_tokens)


def test_a_workspace_of_unsafe_sizes_is_refused_before_it_allocates():
    before = list(workspace._live_workspaces)
    ws = workspace.WorkspaceBase()
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        ws._init_common(world_size=2, rank=0, max_tokens=2 ** 20, hidden=16384, dtype=torch.bfloat16,
                        device_index=0, timeout_s=10.0, oneshot_max_tokens=None, ranks_on_device=1)
    assert list(workspace._live_workspaces) == before


# ---- the default one-shot capacity: the tables' one-shot boundary -------------------------------

H200 = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink")


def _selection(W, hidden=7168, device=H200, dtype="bf16"):
    return table_sets.resolve(dtype=dtype, world_size=W, hidden=hidden, elem_bytes=2, device=device, user=None,
                              program_set_sha256="")


def test_default_oneshot_capacity_is_the_largest_table_boundary():
    from dispatch import registry
    field = dict(registry.program_set().ladder)[registry.ONESHOT_REGIME]
    for device in (H200, gpu_facts.UNKNOWN_DEVICE):
        for W in (2, 4, 8, 16):
            for hidden in (2048, 7168):
                selection = _selection(W, hidden, device)
                bounds = [selection.limits(p)[field] for p in selection.cells]
                assert bounds and selection.oneshot_capacity(field) == max(bounds)
    # the H200 set's one-shot at world size 2 is measured in bytes per rank: more tokens of a smaller row
    assert _selection(2, 2048).oneshot_capacity(field) > _selection(2, 7168).oneshot_capacity(field)
    # elsewhere the written model, in tokens
    assert _selection(8, 2048).oneshot_capacity(field) == _selection(8, 7168).oneshot_capacity(field) == 16


def test_default_oneshot_capacity_changes_no_automatic_selection():
    """Every cell of every table selects the same family at every T with the default capacity as
    with the capacity of 1,024 tokens the workspace had before (and as with an unbounded one)."""
    from dispatch import registry
    field = dict(registry.program_set().ladder)[registry.ONESHOT_REGIME]
    checked = 0
    for W in (2, 4, 8, 16):
        selection = _selection(W)
        for dtype in ("bf16",):
            for profile in selection.cells:
                bounds = selection.limits(profile)
                for max_tokens in (1, 7, 64, 512, 1536):
                    default = min(max_tokens, selection.oneshot_capacity(field))
                    for T in range(1, max_tokens + 1, 1 if max_tokens <= 64 else 5):
                        for shared in (False, True):
                            got = registry.select_family(dtype, W, profile, T, shared, default, bounds=bounds)
                            assert got == registry.select_family(dtype, W, profile, T, shared, min(max_tokens, 1024),
                                                                 bounds=bounds)
                            assert got == registry.select_family(dtype, W, profile, T, shared, 1 << 30, bounds=bounds)
                            checked += 1
    assert checked > 10000


def test_workspace_default_capacity_uses_the_boundary(monkeypatch):
    """_init_common (every Workspace and EmulatedWorld rank) takes min(max_tokens, boundary) unless given."""
    from dispatch import registry
    monkeypatch.setattr(gpu_facts, "describe_device", lambda index: H200)
    field = dict(registry.program_set().ladder)[registry.ONESHOT_REGIME]
    seen = {}

    class Probe(workspace.WorkspaceBase):
        pass

    for W, max_tokens, given, want in ((8, 1024, None, 16), (8, 10, None, 10), (4, 1024, 1024, 1024),
                                       (16, 4096, None, 8), (2, 1024, None, 292)):
        ws = Probe.__new__(Probe)
        try:
            ws._init_common(W, 0, max_tokens, 7168, torch.bfloat16, 0, 10.0, given, 1)
        except Exception:  # noqa: BLE001 - past the sizes, the geometry may need a GPU's limits
            pass
        assert ws.oneshot_max_tokens == want, (W, max_tokens, given)
        assert ws.buffer_elems == buffer_elems_for(W, max_tokens, 7168, want)
        seen[W] = ws.selection.oneshot_capacity(field)
    assert seen == {8: 16, 4: 64, 16: 8, 2: 4 * 2**20 // (7168 * 2)}  # world size 2: 4 MiB a rank
