"""Roofline: the bytes the op must move through HBM and over NVLink (per rank, by exchange regime),
and the HBM and peer-copy bandwidths measured in the same run; the floor is the larger of the two
times. The read floor (world size 1's floor_us): the bandwidth of a kernel that only streams bytes
in (a device copy also writes, and under-reports what a read-heavy kernel reaches)."""
from __future__ import annotations

import time

from moe_ar_tools.bench.config import FP8_PROFILES
from moe_ar_tools.bench.timing import median


def hbm_bytes(tokens: int, hidden: int, top_k: int, shared: bool, profile: str, elem_bytes: int = 2,
              dropped_routes: int = 0, scale_bytes: int = 4) -> dict:
    """Bytes one rank's op must move through HBM, by term.

    expert_rows  (T*K - dropped) rows of H elements read (dropped routes read nothing)
    routing      expanded_idx_to_permuted_idx (int32) and expert_scale_factor, T*K entries each
    shared       the shared expert's [T, H] partial, read once (if present)
    residual     residual_in [T, H], read once
    norm_weight  gamma [H]
    outputs      residual_out and norm_out [T, H], written once each
    nvfp4        quant_out T*H/2 bytes + the swizzled scale bytes (profile nvfp4 only)
    fp8          quant_out T*H bytes (+ T*H/128 float32 scales for fp8_group128)
    """
    from dispatch.op import scale_out_bytes  # the runtime's rule (importing dispatch loads torch)
    T, H, K, E = tokens, hidden, top_k, elem_bytes
    terms = {
        "expert_rows": (T * K - dropped_routes) * H * E,
        "routing": T * K * (4 + scale_bytes),
        "shared": T * H * E if shared else 0,
        "residual": T * H * E,
        "norm_weight": H * E,
        "outputs": 2 * T * H * E,
        "nvfp4": (T * H // 2 + scale_out_bytes(T, H)) if profile == "nvfp4" else 0,
        "fp8": T * H + (T * (H // 128) * 4 if profile == "fp8_group128" else 0) if profile in FP8_PROFILES else 0,
    }
    terms["total"] = sum(terms.values())
    return terms


def nvlink_bytes(tokens: int, hidden: int, world_size: int, regime: str, elem_bytes: int = 2) -> float:
    """Bytes one rank sends over NVLink: one-shot sends its whole partial to every peer,
    (W-1)*T*H*e; two-shot (and NCCL's ring) sends (W-1)/W of it in the reduce-scatter and as
    much again in the all-gather, 2*(W-1)/W*T*H*e."""
    payload = tokens * hidden * elem_bytes
    if regime == "one_shot":
        return float((world_size - 1) * payload)
    if regime == "two_shot":
        return 2.0 * (world_size - 1) / world_size * payload
    raise ValueError(f"regime {regime!r}: expected one_shot or two_shot")


def roofline(hbm: float, nvlink: float, hbm_GBps: float, nvlink_GBps: float) -> dict:
    """Times (microseconds) to move the bytes at the measured bandwidths; the floor is the larger."""
    hbm_us = hbm / (hbm_GBps * 1e9) * 1e6
    nvlink_us = nvlink / (nvlink_GBps * 1e9) * 1e6 if nvlink else 0.0
    return {"hbm_us": hbm_us, "nvlink_us": nvlink_us, "roofline_us": max(hbm_us, nvlink_us),
            "bound": "hbm" if hbm_us >= nvlink_us else "nvlink"}


def regime_of_family(family: str) -> str:
    return "one_shot" if family == "oneshot" else "two_shot"


# ---- bandwidth ---------------------------------------------------------------------------------

def measure_bandwidth(world: int, gib: float, reps: int = 10) -> dict:
    """Measured on rank 0 while the other ranks wait on the CPU.

    hbm_GBps     a device-to-device copy of `gib` GiB on GPU 0, read + write bytes counted
    nvlink_GBps  a copy of `gib` GiB from GPU 0 to GPU 1 (one way, copy engines over NVLink)
    Each the median of `reps` copies after two warm-up copies."""
    import torch
    nbytes = int(gib * 2 ** 30)
    out = {"bytes": nbytes, "reps": reps}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    out["hbm_GBps"] = 2 * nbytes / median(times) / 1e9
    del dst
    if world >= 2 and torch.cuda.device_count() >= 2:
        peer = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        times = []
        for i in range(reps + 2):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            peer.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out["nvlink_GBps"] = nbytes / median(times) / 1e9
        out["nvlink_method"] = "tensor copy cuda:0 -> cuda:1, host-timed with device synchronizes"
        del peer
    else:
        out["nvlink_GBps"] = None
    del src
    for d in range(min(2, torch.cuda.device_count())):  # give back this process's copy buffers
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
    return out


# ---- the read floor ----------------------------------------------------------------------------

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
    """The best of a few grid shapes streaming a `gib` GiB buffer, each the fastest of `reps` launches
    after one warm-up: {"read_gbps": best, "configs": {"BxT": GB/s}, "bytes": n}."""
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
