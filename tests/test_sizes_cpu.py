"""Workspace sizes the kernel's 32-bit counts can hold (dispatch.workspace.check_sizes), without a GPU.

The kernel keeps a buffer's extent in 16-byte vectors in a 32-bit state word, and products of the
token count with small factors (vectors a thread, top_k, FP8 scale groups) in 32-bit ints; a
workspace whose sizes could overflow one of them is refused when it is made, with a ValueError
naming the argument."""
import pytest
import torch

from dispatch import workspace
from dispatch.workspace import MAX_BUFFER_VECTORS, MAX_HIDDEN, MAX_TOKENS, buffer_elems_for, check_sizes

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
    ws = workspace._WorkspaceBase()
    with pytest.raises(ValueError, match=r"^max_tokens: "):
        ws._init_common(world_size=2, rank=0, max_tokens=2 ** 20, hidden=16384, dtype=torch.bfloat16,
                        device_index=0, timeout_s=10.0, oneshot_max_tokens=None, ranks_on_device=1)
    assert list(workspace._live_workspaces) == before
