"""A workspace's sizes: the elements of its rotating buffers, what the kernel's 32-bit counts can
hold, and the row split (threads a row) of a call. Pure arithmetic: no GPU, no torch."""
from __future__ import annotations

from typing import NamedTuple

ALL_TOKENS = 2**31 - 1  # the last row split covers every call


class RowSplit(NamedTuple):
    """Calls of up to `max_tokens` tokens spread a row over `threads` threads (a block), each
    holding up to `vec_per_thread` 16-byte vectors."""
    max_tokens: int
    threads: int
    vec_per_thread: int


def row_split(nvec: int, vec_per_thread: int, max_tokens: int) -> RowSplit:
    threads = 32 * -(-nvec // (32 * vec_per_thread))  # whole warps
    return RowSplit(max_tokens, threads, -(-nvec // threads))


def cluster_row_split(split: RowSplit, nvec: int, min_warps: int, cluster_blocks: int, max_threads: int) -> RowSplit:
    """World size 1's latency split (its one-block layout) for a row of min_warps warps or more
    (the manifest's cluster_round_min_warps), 2 vectors a thread or fewer: its warps rounded up to a multiple of
    cluster_blocks, the last vector places masked (H 7168: 512 threads, not 448; H 6144: 16 warps,
    not 12): as fast or faster than the row split at 64-128 tokens on an H200
    (bench_results/world_size_1/row_threads/)."""
    warps = split.threads // 32
    if split.vec_per_thread > 2 or split.threads % 32 or warps < min_warps:
        return split
    threads = 32 * cluster_blocks * -(-warps // cluster_blocks)
    if threads > max_threads:
        return split
    return RowSplit(split.max_tokens, threads, -(-nvec // threads))


def cluster_layout_split(nvec: int, cluster_blocks: int, max_tokens: int) -> RowSplit:
    """World size 1's cluster layout (few tokens, a token over a cluster of cluster_blocks blocks): one
    16-byte vector a thread, the row's warps rounded up to whole clusters (H 7168: 8 blocks of 4 warps,
    1,024 threads, the last 128 masked). A token's bits are the one-block layout's all the same: the
    sum of squares takes one order whatever the split (kernels/block_sum.cuh)."""
    return RowSplit(max_tokens, 32 * cluster_blocks * -(-nvec // (32 * cluster_blocks)), 1)


# What the kernel's 32-bit counts hold (kernels/): T times small factors
# stays an int (the largest, FP8-group scale offsets: (H / 128 - 1) * roundup(T, 4) < 2^31), and a buffer's
# extent is kept in 16-byte vectors in a 32-bit state word.
MAX_TOKENS = 1 << 24
MAX_HIDDEN = 1 << 14
MAX_BUFFER_VECTORS = (1 << 32) - 1


def check_sizes(world_size: int, max_tokens: int, hidden: int, oneshot_max_tokens: int) -> None:
    """ValueError naming the argument when a workspace of these sizes needs a count the kernel keeps
    in 32 bits to hold more than it can."""
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden: {hidden}, more than the kernel's {MAX_HIDDEN}")
    if max_tokens > MAX_TOKENS:
        raise ValueError(f"max_tokens: {max_tokens}, more than the kernel's 32-bit counts allow ({MAX_TOKENS})")
    oneshot = world_size * oneshot_max_tokens * hidden
    twoshot = buffer_elems_for(world_size, max_tokens, hidden, 0)
    vectors = max(oneshot, twoshot) // 8
    if vectors > MAX_BUFFER_VECTORS:
        name = "oneshot_max_tokens" if oneshot > twoshot else "max_tokens"
        raise ValueError(f"{name}: {oneshot_max_tokens if oneshot > twoshot else max_tokens} tokens at hidden "
                         f"{hidden} and world size {world_size} need rotating buffers of {vectors} 16-byte vectors, "
                         f"more than the kernel's 32-bit extents hold ({MAX_BUFFER_VECTORS})")


def buffer_elems_for(world_size: int, max_tokens: int, hidden: int, oneshot_max_tokens: int) -> int:
    """Elements of one rotating buffer: the larger of the one-shot and two-shot layouts (none at world
    size 1, which exchanges nothing)."""
    if world_size == 1:
        return 0
    oneshot = world_size * oneshot_max_tokens * hidden
    per_owner = -(-max_tokens // world_size)
    twoshot = world_size * per_owner * hidden + max_tokens * hidden
    return max(oneshot, twoshot)
