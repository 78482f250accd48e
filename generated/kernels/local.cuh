// World size 1 (the local regime): nothing is exchanged, so nothing is rounded before the residual add.
// Each token row is finalized in fp32 (finalize.cuh's partial_f32: the same loads and the same order
// of additions as an exchanging rank's partial), residual_in is added in fp32, the sum is rounded once
// to residual_out, then the row epilogue (norm.cuh: RMSNorm, quant) runs as in the other regimes.
// No buffers, no peers, no sentinel, no deadline, no poisoned output and no call counter: the only
// state word used is kBadRows, the count of skipped out-of-range routes (dispatch check() reads it).
#pragma once
#include "call.cuh"
#include "finalize.cuh"
#include "fp8.cuh"
#include "lamport.cuh"
#include "norm.cuh"
#include "nvfp4.cuh"
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// Blocks stride over token rows (a grid of at most the co-resident blocks); a row is spread over the
// block's threads, vec_per_thread 16-byte vectors a thread, as in the exchanges' last phase.
template <typename D, Profile P, int kRoutes, bool kSharedFirst>
__device__ __forceinline__ void run_local(const Params& p) {
  wait_for_previous_kernel();  // inputs and outputs belong to the previous kernel until here
  // The next kernel's griddepcontrol.wait still waits for this whole grid to finish and its writes to
  // be visible, and this grid is all resident at once (dispatch sizes it so): letting the next kernel
  // launch now only lets its blocks take the multiprocessors' free room early.
  allow_next_kernel();
  const int T = p.tokens, H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  unsigned bad_rows = 0;
  if (P == Profile::kNvfp4) fill_nvfp4_reciprocals(p);  // read after the first row's block_sum barriers
  if (P == Profile::kNvfp4) zero_scale_padding(p);
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];  // residual_out, in the dtype
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      res[r] = make_uint4(0, 0, 0, 0);
      if (r >= vpt || v >= nvec) continue;
      float s[8];
      partial_f32<D, /*kSharedPrefetch=*/false, kRoutes, kSharedFirst>(p, t, v, bad_rows, s);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += 0.f;  // the sum starts from +0.0, as the exchanges' does: a zero is +0.0
      add_residual<D>(p, t, v, s);  // residual_in[t] read before residual_out[t] is written (in place)
      res[r] = Vec<D>::from_float(s);
      reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H)[v] = res[r];
    }
    norm_row<D, P>(p, t, res);
  }
  if (bad_rows) atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows);
}

}  // namespace moe_ar
