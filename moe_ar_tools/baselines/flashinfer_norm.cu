// A C entry point to FlashInfer's CUDA norm kernels (include/flashinfer/norm.cuh of the release that
// fetch_flashinfer.sh extracts), loaded with ctypes by flashinfer_norm.py: the same kernel templates,
// launch configuration and PDL flag as FlashInfer's own binding (csrc/norm.cu), without its Python
// package. Each function launches on `stream` and returns the cudaError_t.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <flashinfer/norm.cuh>

namespace {
template <typename T>
int add_rmsnorm(void* input, void* residual, void* weight, unsigned tokens, unsigned hidden, float eps, bool pdl,
                cudaStream_t stream) {
  return static_cast<int>(flashinfer::norm::FusedAddRMSNorm<T>(static_cast<T*>(input), static_cast<T*>(residual),
                                                               static_cast<T*>(weight), tokens, hidden, hidden,
                                                               hidden, eps, pdl, stream));
}

template <typename T>
int add_rmsnorm_fp8(void* input, void* residual, void* weight, void* out, unsigned tokens, unsigned hidden,
                    float scale, float* scale_on_device, float eps, bool pdl, cudaStream_t stream) {
#ifdef MOE_AR_FI_SCALE_ON_DEVICE  // 0.7.4 reads the scale from a device pointer, 0.6.5 takes a float
  (void)scale;
  auto scale_arg = scale_on_device;
#else
  (void)scale_on_device;
  auto scale_arg = scale;
#endif
  return static_cast<int>(flashinfer::norm::FusedAddRMSNormQuant<T, __nv_fp8_e4m3>(
      static_cast<T*>(input), static_cast<T*>(residual), static_cast<T*>(weight), static_cast<__nv_fp8_e4m3*>(out),
      tokens, hidden, hidden, hidden, hidden, scale_arg, eps, pdl, stream));
}
}  // namespace

// residual += input; input = RMSNorm(residual) * weight. bf16: dtype 0, fp16: dtype 1.
extern "C" int moe_ar_fi_fused_add_rmsnorm(void* input, void* residual, void* weight, unsigned tokens,
                                           unsigned hidden, int dtype, float eps, int pdl, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return dtype == 0 ? add_rmsnorm<__nv_bfloat16>(input, residual, weight, tokens, hidden, eps, pdl != 0, s)
                    : add_rmsnorm<__half>(input, residual, weight, tokens, hidden, eps, pdl != 0, s);
}

// residual += input; out = e4m3(clamp(RMSNorm(residual) * weight / scale, -448, 448)); input unchanged.
extern "C" int moe_ar_fi_fused_add_rmsnorm_fp8(void* input, void* residual, void* weight, void* out, unsigned tokens,
                                               unsigned hidden, int dtype, float scale, float* scale_on_device,
                                               float eps, int pdl, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return dtype == 0 ? add_rmsnorm_fp8<__nv_bfloat16>(input, residual, weight, out, tokens, hidden, scale,
                                                     scale_on_device, eps, pdl != 0, s)
                    : add_rmsnorm_fp8<__half>(input, residual, weight, out, tokens, hidden, scale, scale_on_device,
                                              eps, pdl != 0, s);
}

extern "C" const char* moe_ar_fi_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
