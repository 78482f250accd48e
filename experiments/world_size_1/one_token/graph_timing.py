"""The probes' timing: `calls` launches captured in one CUDA graph (cycling over `n_sets` input sets),
replayed `reps` times; the median time a call in us, as bench_one times every system."""
import statistics
import time

import cupy as cp
import torch


def warm_up(seconds: float = 2.0) -> None:
    """Raise the GPU's clocks before the first timing (a process's first timing runs slow)."""
    a = torch.randn(8192, 8192, device="cuda")
    start = time.time()
    while time.time() - start < seconds:
        a @ a
    torch.cuda.synchronize()


def timed(launch, n_sets: int, calls: int, reps: int = 50) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            launch(i % n_sets)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                for i in range(calls):
                    launch(i % n_sets)
    torch.cuda.synchronize()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); graph.replay(); end.record(); end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return round(statistics.median(times), 3)
