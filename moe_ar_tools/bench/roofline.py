"""Roofline: the bytes the op must move through HBM and over NVLink (per rank, by exchange regime),
and the HBM and peer-copy bandwidths measured in the same run; the floor is the larger of the two
times."""
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
