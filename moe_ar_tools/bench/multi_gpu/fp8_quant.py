"""The separate FP8 quantization kernel of the auto+quant baseline (compiled with NVRTC, launched
on torch's stream)."""


# The separate quantization kernel of the auto+quant baseline: what an unfused engine runs after
# the plain fused step (vLLM's / SGLang's per_token_group_quant_fp8, or a static per-tensor
# quantization), written as one good kernel so that the comparison is fair: each thread quantizes
# 8 elements (one 16-byte load), 16 threads (a half warp) share a 128-element group's amax.
_FP8_QUANT_SOURCE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
template <typename D> __device__ __forceinline__ float to_f(D x);
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename D>
__device__ void fp8_quant(const D* x, unsigned char* q, float* scales, const float* tensor_scale, long long nvec,
                          int hidden) {
  const long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // nvec is a multiple of 16
  float f[8], amax = 0.f;
  if (v < nvec) {
    const uint4 raw = reinterpret_cast<const uint4*>(x)[v];
    const D* e = reinterpret_cast<const D*>(&raw);
    for (int i = 0; i < 8; ++i) { f[i] = to_f(e[i]); amax = fmaxf(amax, fabsf(f[i])); }
  }
  float s;
  if (tensor_scale != nullptr) {
    s = *tensor_scale;
  } else {
    for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = __fdiv_rn(fmaxf(amax, 1e-10f), 448.f);
  }
  if (v >= nvec) return;
  unsigned b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = __nv_cvt_float_to_fp8(fminf(fmaxf(__fdiv_rn(f[i], s), -448.f), 448.f), __NV_SATFINITE, __NV_E4M3);
  reinterpret_cast<uint2*>(q)[v] = make_uint2(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24,
                                              b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24);
  if (tensor_scale == nullptr && v % 16 == 0) scales[v / 16] = s;  // row-major [T, H/128]
}
extern "C" __global__ void fp8_quant_bf16(const __nv_bfloat16* x, unsigned char* q, float* scales,
                                          const float* tensor_scale, long long nvec, int hidden) {
  fp8_quant(x, q, scales, tensor_scale, nvec, hidden);
}
extern "C" __global__ void fp8_quant_fp16(const __half* x, unsigned char* q, float* scales,
                                          const float* tensor_scale, long long nvec, int hidden) {
  fp8_quant(x, q, scales, tensor_scale, nvec, hidden);
}
"""


class Fp8QuantKernel:
    """_FP8_QUANT_SOURCE compiled with the programs' NVRTC options and launched on torch's stream."""

    def __init__(self, device_index: int):
        import cupy
        from cupy.cuda import function
        from dispatch import registry
        capability = cupy.cuda.Device(device_index).compute_capability  # "90" for sm_90
        target = registry.TARGET_FOR_CAPABILITY[(int(capability[:-1]), int(capability[-1]))]
        cubin, _ = registry.compile_cubin(_FP8_QUANT_SOURCE, "bench_fp8_quant", target)
        with cupy.cuda.Device(device_index):
            self.module = function.Module()
            self.module.load(cubin)
            self.functions = {name: self.module.get_function(f"fp8_quant_{name}") for name in ("bf16", "fp16")}

    def __call__(self, norm_out, quant_out, scales, tensor_scale) -> None:
        """quant_out = FP8 of norm_out [T, H]; scales: [T, H/128] float32 (group scales, written) or
        None; tensor_scale: a [1] float32 device tensor (per-tensor scale, read) or None."""
        import ctypes
        import torch
        from cuda.bindings import driver as cu
        nvec = norm_out.numel() // 8
        function = self.functions["bf16" if norm_out.dtype == torch.bfloat16 else "fp16"]
        args = ((norm_out.data_ptr(), quant_out.data_ptr(), scales.data_ptr() if scales is not None else 0,
                 tensor_scale.data_ptr() if tensor_scale is not None else 0, nvec, norm_out.shape[1]),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int))
        err, = cu.cuLaunchKernel(cu.CUfunction(int(function.ptr)), -(-nvec // 256), 1, 1, 256, 1, 1, 0,
                                 cu.CUstream(torch.cuda.current_stream().cuda_stream), args, 0)
        if int(err) != 0:
            raise RuntimeError(f"fp8 quant kernel launch failed: {err}")
