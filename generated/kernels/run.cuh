// The kernel body, run<...>(p), which every program instantiates: one call of the one-shot, the
// two-shot or the early two-shot (the pipelined two-shot, pipelined.cuh, and world size 1's local
// regime, local.cuh, are entered from here).
//   one-shot:   partial -> every peer's slot[rank][t]      | poll W slots, sum in rank order,
//                                                          | + residual, norm, quant (all tokens)
//   two-shot:   partial -> owner(t)'s slot[rank][t]        | owner: poll W slots, sum, + residual,
//               (owner(t) = t / ceil(T / W))               |   residual_out -> every rank's row t
//                                                          | all: poll row t, norm, quant
#pragma once
#include "call.cuh"
#include "finalize.cuh"
#include "fp8.cuh"
#include "lamport.cuh"
#include "local.cuh"
#include "norm.cuh"
#include "nvfp4.cuh"
#include "params.cuh"
#include "pipelined.cuh"
#include "poison.cuh"
#include "vector.cuh"

namespace moe_ar {

// kRoutes and kSharedFirst (partial_vector) come from the program (spec.loads_in_flight): the
// one-shot and the pipelined two-shot without the row ring set them; the two-shot programs keep four
// routes at a time, the shared row last. kRowStages: the pipelined two-shot's row ring (0: none).
// Returns whether this block must write the poisoned output over its rows (run does, at one call site).
template <typename D, int W, Profile P, Regime R, bool kSharedPrefetch, int kRoutes, bool kSharedFirst, int kRowStages>
__device__ __forceinline__ bool run_call(const Params& p) {
  static_assert(W >= 2 && W <= kMaxWorldSize, "world size");
  const int T = p.tokens, H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread;
  // Whole rows per work unit, or one blockDim-wide slice of a row ("round") per unit.
  const bool sliced_send = R == Regime::kOneShot || R == Regime::kTwoShotEarly;
  wait_for_previous_kernel();  // inputs and workspace belong to the previous kernel until here

  Deadline deadline{p.timeout_ns ? global_timer_ns() + p.timeout_ns : 0ull, false};
  unsigned bad_rows = 0;

  // The pipelined two-shot quantizes its first rows while it still sends; the others fill the table
  // after sending their partials, off the one-shot's critical path (bench_results/nvfp4_epilogue/).
  if (P == Profile::kNvfp4 && R == Regime::kTwoShotPipelined) fill_nvfp4_reciprocals(p);

  const unsigned call = load_state(p.state + kCallCounter);
  const unsigned poisoned_at = load_state(p.state + kPoisoned);  // the same sector as the call counter
  deadline.call = call;
  const int cur = call % 3, prev = (call + 2) % 3;
  const long long prev_extent_vectors = load_state(p.state + kExtent0 + prev);
  const Layout lay = layout_of<R, W>(T, H);
  D* my_buffer = static_cast<D*>(buffer_of<W>(p, p.rank)) + cur * p.buffer_elems;

  // Pull what the waits are followed by toward L2 now, so it is not a DRAM trip after the wait:
  // gamma, and the residual row of this block's first reduced token.
  {
    const int first_reduced = R == Regime::kOneShot ? blockIdx.x : p.rank * lay.tokens_per_owner + blockIdx.x;
    for (int r = 0; r < vpt; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (v >= nvec) break;
      prefetch_l2(static_cast<const D*>(p.norm_weight) + v * kElemsPerVec);
      if (first_reduced < T)
        prefetch_l2(static_cast<const D*>(p.residual_in) + (long long)first_reduced * H + v * kElemsPerVec);
    }
  }

  // Shared-expert variants: pull this block's shared rows toward L2 before anything waits.
  if (kSharedPrefetch && p.shared_in != nullptr) {
    const int units = sliced_send ? T * vpt : T;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int t = sliced_send ? u / vpt : u;
      for (int r = sliced_send ? u % vpt : 0; r < (sliced_send ? u % vpt + 1 : vpt); ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (v < nvec) prefetch_l2(static_cast<const D*>(p.shared_in) + (long long)t * H + v * kElemsPerVec);
      }
    }
  }

  // A wait of an earlier call timed out (kPoisoned): poisoned output, no exchange, no state change.
  // Checked here, after the prefetches, which hide the latency of its load.
  if (__builtin_expect(poisoned_at != 0 && poisoned_at != call + 1, 0)) {
    if (P == Profile::kNvfp4) zero_scale_padding(p);
    if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
    return true;
  }

  if constexpr (R == Regime::kTwoShotPipelined) {
    if (!p.fault_stop_after) {  // the injected fault takes the two-shot's path below
      pipelined_two_shot<D, W, P, kRoutes, kSharedFirst, kRowStages>(p, lay, cur, prev_extent_vectors, deadline,
                                                                      bad_rows);
      bool gave_up = timed_out_in_this_call(p, call);
      // it leaves its buffer clean: nothing to clear. The ring counts skipped routes (nvec loads each).
      finish_call(p, count_in(p, gave_up), call, cur, prev, 0, bad_rows, kRowStages > 0 ? nvec : 1);
      return gave_up;
    }
  }

  // ---- phase 1: send this rank's partial of every token ------------------------------------
  {
    const int all_units = sliced_send ? T * vpt : T;
    // Fault injection (tests only): a rank with fault_stop_after = n sends its first n units and stops.
    const int units = p.fault_stop_after ? min(p.fault_stop_after, all_units) : all_units;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int t = sliced_send ? u / vpt : u;
      const int r_begin = sliced_send ? u % vpt : 0, r_end = sliced_send ? r_begin + 1 : vpt;
      for (int r = r_begin; r < r_end; ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (v >= nvec) continue;
        const uint4 partial = partial_vector<D, kSharedPrefetch, kRoutes, kSharedFirst>(p, t, v, bad_rows);
        if (R == Regime::kOneShot) {
          const long long offset = cur * p.buffer_elems + ((long long)p.rank * T + t) * H + v * kElemsPerVec;
#pragma unroll
          for (int q = 0; q < W; ++q)
            *reinterpret_cast<uint4*>(static_cast<D*>(p.peer_buffers[q]) + offset) = partial;
        } else {
          const int owner = t / lay.tokens_per_owner, j = t - owner * lay.tokens_per_owner;
          const long long offset =
              cur * p.buffer_elems + ((long long)p.rank * lay.tokens_per_owner + j) * H + v * kElemsPerVec;
          *reinterpret_cast<uint4*>(static_cast<D*>(buffer_of<W>(p, owner)) + offset) = partial;
        }
      }
    }
  }
  allow_next_kernel();
  if (p.fault_stop_after) return false;  // the injected fault: this rank never takes part again in this call
  if (R == Regime::kTwoShotPipelined) return false;  // not reached (it ran above); keeps what follows out of its code
  if (P == Profile::kNvfp4) fill_nvfp4_reciprocals(p);  // read after the first row's block_sum barriers

  // ---- clear the buffer of the previous call (and the quantized outputs' scale padding) -------
  {
    uint4* prev_buffer = reinterpret_cast<uint4*>(static_cast<D*>(buffer_of<W>(p, p.rank)) + prev * p.buffer_elems);
    const long long n = prev_extent_vectors;
    const uint4 sentinel = make_uint4(kSentinelWord, kSentinelWord, kSentinelWord, kSentinelWord);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
      prev_buffer[i] = sentinel;
    if (P == Profile::kNvfp4) zero_scale_padding(p);
    if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  }
  const unsigned counted_before = R == Regime::kOneShot ? count_in(p) : 0u;  // the two-shots: at their end

  // ---- two-shot phase 2: the owner reduces its tokens and sends residual_out to every rank --
  if (R != Regime::kOneShot) {
    const int C = lay.tokens_per_owner;
    const int first = p.rank * C, mine = max(0, min(C, T - first));
    const bool sliced = R == Regime::kTwoShotEarly;
    const int units = sliced ? mine * vpt : mine;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int j = sliced ? u / vpt : u, t = first + j;
      const int r_begin = sliced ? u % vpt : 0, r_end = sliced ? r_begin + 1 : vpt;
      uint4 sum[kMaxVecPerThread];
      wait_and_reduce<D, W, true, (W > 8)>(my_buffer + (long long)j * H, (long long)C * H, r_begin, r_end, t, sum,
                                           deadline, p, kPhaseReduceScatter);
      if (deadline.expired) continue;  // peers must time out too, not take this row as the sum
#pragma unroll
      for (int r = 0; r < kMaxVecPerThread; ++r) {
        const int v = r * blockDim.x + threadIdx.x;
        if (r < r_begin || r >= r_end || v >= nvec) continue;
        const uint4 res = without_sentinel(sum[r]);
        const long long offset = cur * p.buffer_elems + lay.gather_base + (long long)t * H + v * kElemsPerVec;
#pragma unroll
        for (int q = 0; q < W; ++q) *reinterpret_cast<uint4*>(static_cast<D*>(p.peer_buffers[q]) + offset) = res;
      }
    }
  }

  // ---- last phase, whole rows: residual_out, RMSNorm, quant --------------------------------
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];  // residual_out, already in the dtype
    if (R == Regime::kOneShot)
      wait_and_reduce<D, W, true>(my_buffer + (long long)t * H, (long long)T * H, 0, vpt, t, res, deadline, p,
                                  kPhaseOneShot);
    else
      wait_and_reduce<D, 1, false>(my_buffer + lay.gather_base + (long long)t * H, 0, 0, vpt, t, res, deadline, p,
                                   kPhaseAllGather);
#pragma unroll
    for (int r = 0; r < kMaxVecPerThread; ++r) {
      const int v = r * blockDim.x + threadIdx.x;
      if (r < vpt && v < nvec) reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H)[v] = res[r];
    }
    norm_row<D, P>(p, t, res);
  }

  // The one-shot, the shortest, ORs its threads' own flags (no load at its end).
  bool gave_up = R == Regime::kOneShot ? deadline.expired : timed_out_in_this_call(p, call);
  unsigned counted = counted_before;
  if (R == Regime::kOneShot) gave_up = __syncthreads_or(gave_up);
  else counted = count_in(p, gave_up);
  finish_call(p, counted, call, cur, prev, lay.extent, bad_rows);
  return gave_up;
}

template <typename D, int W, Profile P, Regime R, bool kSharedPrefetch, int kRoutes = 4, bool kSharedFirst = false,
          int kRowStages = 0>
__device__ __forceinline__ void run(const Params& p) {
  constexpr bool kLocalRegime = R == Regime::kLocal || R == Regime::kLocalStreaming;
  static_assert(kLocalRegime ? W == 1 : W >= 2 && W <= kMaxWorldSize,
                "world size: 1 runs the local regimes and only they, 2..kMaxWorldSize the exchanges");
  static_assert(!kLocalRegime || kRowStages == 0, "world size 1 has no row ring");
  if constexpr (kLocalRegime) {
    run_local<D, P, R, kRoutes, kSharedFirst>(p);
  } else {
    // After the call's state changes: nothing stays live across the out-of-line poison_block_rows.
    if (__builtin_expect(run_call<D, W, P, R, kSharedPrefetch, kRoutes, kSharedFirst, kRowStages>(p), 0))
      poison_block_rows<P, R>(p);
  }
}

}  // namespace moe_ar
