"""The read floor of a run: the bandwidth of a kernel that only streams bytes in (a device copy also
writes, and under-reports what a read-heavy kernel reaches). The best of a few grid shapes over a
`gib` GiB buffer, each the fastest of `reps` launches after one warm-up."""
from __future__ import annotations

READ_SOURCE = r'''
extern "C" __global__ void moe_ar_read_floor(const uint4* __restrict__ x, long long n, unsigned* out) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {  // four independent 16-byte loads in flight a thread
    const uint4 a = __ldcs(x + i), b = __ldcs(x + i + stride), c = __ldcs(x + i + 2 * stride),
                d = __ldcs(x + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) { const uint4 a = __ldcs(x + i); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads; practically never taken
}
'''
GRIDS = ((4, 512), (8, 256), (2, 1024), (16, 256))  # (blocks a multiprocessor, threads a block)


def measure_read_bandwidth(device_index: int, gib: float, reps: int = 6) -> dict:
    """{"read_gbps": best, "configs": {"BxT": GB/s}, "bytes": n}."""
    import cupy
    import numpy as np
    import torch
    from cupy.cuda import function
    from dispatch import registry
    capability = cupy.cuda.Device(device_index).compute_capability
    target = registry.TARGET_FOR_CAPABILITY[(int(capability[:-1]), int(capability[-1]))]
    cubin, _ = registry.compile_cubin(READ_SOURCE, "bench_read_floor", target)
    device = torch.device("cuda", device_index)
    nbytes = int(gib * 2 ** 30) // 16 * 16
    buf = torch.randint(0, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    out = torch.zeros(4, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    configs = {}
    with cupy.cuda.Device(device_index):
        module = function.Module()
        module.load(cubin)
        fn = module.get_function("moe_ar_read_floor")
        args = (np.uint64(buf.data_ptr()), np.int64(nbytes // 16), np.uint64(out.data_ptr()))
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
            for blocks, threads in GRIDS:
                times = []
                for _ in range(reps + 1):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn((sms * blocks, 1, 1), (threads, 1, 1), args)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                configs[f"{blocks}x{threads}"] = nbytes / min(times[1:]) / 1e9
    del buf
    return {"read_gbps": max(configs.values()), "configs": configs, "bytes": nbytes}
