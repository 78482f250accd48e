"""The timing core of every world size (docs/measurement.md): medians and the one percentile,
per-replay ratios, the shuffled interleaved replay orders, the slowest rank, how many input sets the
captured calls rotate through (L2 warm or cold), and on the GPU the CUDA-graph capture of a
system's calls and the event-timed interleaved replays (torch imported inside)."""
from __future__ import annotations

import math
import random
import statistics
import time


def median(xs) -> float:
    xs = [float(x) for x in xs]
    if not xs:
        raise ValueError("median of nothing")
    return float(statistics.median(xs))


def percentile(xs, q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(float(x) for x in xs)
    if not xs:
        raise ValueError("percentile of nothing")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pair_ratio(times, baseline_times) -> float:
    """Median over replays i of times[i] / baseline_times[i] (below 1: faster than the baseline).

    The two series come from the same interleaved loop, replay i of both in the same round,
    so slow drift of the machine cancels in each ratio."""
    if len(times) != len(baseline_times) or not times:
        raise ValueError(f"pair_ratio: {len(times)} and {len(baseline_times)} replays")
    return median(a / b for a, b in zip(times, baseline_times))


def replay_orders(n: int, rounds: int, seed: int) -> list[list[int]]:
    """The order of the n systems in each of `rounds` rounds: every round replays each system
    once (interleaved, docs/measurement.md), in an order shuffled per round. A fixed order puts one system
    always after the same neighbour (the baselines, say) and at the same place in the round:
    auto, replayed first after the baselines, measured up to 7% slower than the very program it
    ran at 16 NVFP4 tokens and 2.5-3.5% faster at 2,048-16,384 tokens. The orders depend only on
    the arguments, so every rank replays the same sequence (collectives must match)."""
    if n < 1 or rounds < 1:
        raise ValueError(f"replay_orders: n={n} systems and rounds={rounds} must be positive")
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def slowest_rank(per_rank_times) -> list[float]:
    """[rank][replay] -> [replay]: the maximum over ranks (the step ends when the slowest does)."""
    return [max(col) for col in zip(*per_rank_times)]


def input_sets_for(bytes_per_set: int, l2_bytes: int, calls: int) -> int:
    """How many input sets the captured calls rotate through: enough that the sets together are
    at least twice the L2 (so a call does not find the previous call's inputs cached), at most
    one per call."""
    return max(1, min(calls, -(-2 * l2_bytes // max(1, bytes_per_set))))


COLD_L2_MULTIPLE = 3  # cold_input_sets: the sets together fill this many times the L2
MAX_COLD_SETS = 4096  # 3x a 60 MiB L2 at one token of H 2048, top_k 8: 3,850 sets


def cold_input_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """The sets a cold point rotates through, each call its own set when the sets outnumber the calls:
    together more than COLD_L2_MULTIPLE x the L2 (inputs and outputs counted), at most MAX_COLD_SETS."""
    return min(MAX_COLD_SETS, max(1, -(-COLD_L2_MULTIPLE * l2_bytes // max(1, bytes_per_set))))


# ---- on the GPU ------------------------------------------------------------------------------------

def capture_graph(call, calls: int, warmup, device, time_first: bool = False) -> tuple:
    """Eager calls call(i) for i in `warmup`, then one CUDA graph of call(0) .. call(calls - 1) back to
    back. Returns (graph, [what each captured call returned], seconds of the first eager call when
    `time_first`: it waits for the GPU, and includes a compiled system's compile). Raises what a call
    or the capture raised."""
    import torch
    first_s = None
    for n, i in enumerate(warmup):
        t0 = time.perf_counter()
        call(i)
        if time_first and n == 0:
            torch.cuda.synchronize(device)
            first_s = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    graph, captured = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            captured.append(call(i))
    torch.cuda.synchronize(device)
    return graph, captured, first_s


def timed_replays(graphs: list, reps: int, seed: int, device) -> list[list[float]]:
    """`reps` rounds; in each round every graph is replayed once, in an order shuffled per round
    (replay_orders), each replay between two CUDA events of this process. Returns [graph][replay]
    milliseconds (a replay of all of a graph's calls)."""
    import torch
    n = len(graphs)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in range(n)]  # [graph][replay] -> (start, end)
    for replay, order in enumerate(replay_orders(n, reps, seed)):
        for j in order:
            start, end = events[j][replay]
            start.record()
            graphs[j].replay()
            end.record()
    torch.cuda.synchronize(device)
    return [[start.elapsed_time(end) for start, end in row] for row in events]
