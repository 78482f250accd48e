// The pipelined two-shot (world size 2): the two-shot's three phases side by side, not one after
// another, over token columns (the families twoshot_pipelined and twoshot_pipelined_loads).
#pragma once
#include "call.cuh"
#include "finalize.cuh"
#include "fp8.cuh"
#include "lamport.cuh"
#include "norm.cuh"
#include "nvfp4.cuh"
#include "params.cuh"
#include "row_ring.cuh"
#include "vector.cuh"

namespace moe_ar {

// Same buffers, layout and Lamport sequence as the two-shot (one protocol class). Column j is token j
// of each owner (t = o * C + j). Block b takes columns b, b + G, b + 2G, ... (G = gridDim.x, which the
// launcher sizes so that every block takes the same number of columns, give or take one: a last
// round that only some blocks run leaves HBM idle; dispatch/op.py, balanced_grid); at its step k it
//   sends this rank's partial of the peer's token of column j_k     (HBM reads, NVLink writes)
//   clears column j_k's share of the previous call's buffer          (HBM writes)
//   reduces its own token of column j_k-1: its own partial computed  (HBM reads, a wait)
//     here, the peer's from the buffer; writes residual_out and
//     norm_out, sends residual_out to the peer                       (HBM and NVLink writes)
//   normalizes the peer's token of column j_k-2 as the peer sent it  (a wait, HBM writes)
// so one column's reads overlap the exchange of the columns before. Two savings in HBM traffic over
// the two-shot: nothing this rank computes goes through its own buffer (the two-shot sends half of
// its partials and residual rows to itself, to HBM and back), and every received vector is cleared
// as soon as it is read, while its line is still in L2, so the call leaves its buffer clean (extent
// 0: the next call clears nothing) and a received line is written back to HBM once, not twice.
// After a timeout the buffer may hold late arrivals; the required reset() refills it.
// Every wait concerns a column whose sends come earlier in both ranks' order than any send still
// waiting behind it, so the exchange always progresses (also when the ranks run different grid
// sizes or mix programs).
// The rows of the partials (phases 1 and 2) and residual_in come through the row ring when
// kRowStages > 0 (RowRing; the family twoshot_pipelined), else as 16-byte register loads, kRoutes
// at a time per vector (partial_vector; twoshot_pipelined_loads, more blocks a multiprocessor).
// The ring is faster at large T, the register loads for NVFP4 and FP8-group at smaller T; the
// selection table says which serves which T (spec.py: PIPELINED_ROW_STAGES, PIPELINED_LOADS, the
// caps). With the ring, residual_in comes through it too, and phase 2 waits for the peer's whole row
// at once rather than vector by vector (bench_results/pipelined/row_ring/).
// Cache policy: what the call touches once goes through L2 evict-first (ld/st .cs, and the ring's
// copies): the routed and shared rows, residual_in, the outputs (norm_out, the quantized row, the
// peer's residual_out rows) and the sentinels that clear received vectors. L2 then keeps what is
// used again within a step: vectors the peer sent, until they are read, and this rank's
// residual_out rows, normalized in phase 3 (bench_results/pipelined/cache_policy/).
template <typename D, int W, Profile P, int kRoutes, bool kSharedFirst, int kRowStages>
__device__ __forceinline__ void pipelined_two_shot(const Params& p, const Layout& lay, int cur,
                                                   long long prev_extent_vectors, Deadline& deadline,
                                                   unsigned& bad_rows) {
  static_assert(W == 2, "the pipelined two-shot is generated for world size 2 only (generator/policy.py)");
  const int T = p.tokens, H = p.hidden, nvec = H / kElemsPerVec, vpt = p.vec_per_thread, C = lay.tokens_per_owner;
  const int G = gridDim.x, peer = 1 - p.rank;
  D* my_buffer = static_cast<D*>(buffer_of<W>(p, p.rank)) + cur * p.buffer_elems;
  D* peer_buffer = static_cast<D*>(buffer_of<W>(p, peer)) + cur * p.buffer_elems;
  uint4* prev_buffer = reinterpret_cast<uint4*>(static_cast<D*>(buffer_of<W>(p, p.rank)) +
                                                ((cur + 2) % 3) * p.buffer_elems);
  const long long clear_n = prev_extent_vectors, clear_per_column = (clear_n + C - 1) / C;
  const uint4 sentinel = make_uint4(kSentinelWord, kSentinelWord, kSentinelWord, kSentinelWord);
  if (P == Profile::kNvfp4) zero_scale_padding(p);
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);

  const int columns = blockIdx.x < C ? (C - 1 - blockIdx.x) / G + 1 : 0;  // this block's columns
  extern __shared__ __align__(128) unsigned char dynamic_smem[];
  RowRing<D, (kRowStages > 0 ? kRowStages : 1)> ring;  // unused without the ring
  if constexpr (kRowStages > 0) ring.start(dynamic_smem, columns, C, p);
  for (int k = 0; k < columns + 2; ++k) {
    const int j1 = blockIdx.x + k * G, j2 = j1 - G, j3 = j2 - G;  // the columns of the three phases
    if (k < columns) {
      // phase 1: this rank's partial of the peer's token of column j1 -> the peer's slot [rank][j1]
      const int t = peer * C + j1;
      if (t < T) {
        uint4* slot = reinterpret_cast<uint4*>(peer_buffer + ((long long)p.rank * C + j1) * H);
        if constexpr (kRowStages > 0) {
          uint4 partial[kMaxVecPerThread];
          partial_row(p, ring, t, partial, bad_rows);
#pragma unroll
          for (int r = 0; r < kMaxVecPerThread; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (r < vpt && v < nvec && !deadline.expired) slot[v] = partial[r];
          }
        } else {
          for (int r = 0; r < vpt; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (v >= nvec) continue;
            const uint4 partial = partial_vector<D, false, kRoutes, kSharedFirst, /*kStreaming=*/true>(p, t, v, bad_rows);
            if (!deadline.expired) slot[v] = partial;
          }
        }
      }
      const long long end = min(clear_n, (j1 + 1) * clear_per_column);
      for (long long i = j1 * clear_per_column + threadIdx.x; i < end; i += blockDim.x) prev_buffer[i] = sentinel;
    }
    if (k == columns) allow_next_kernel();  // this block sends no more partials (also a block with none)
    if (k >= 1 && k - 1 < columns) {
      // phase 2: this rank's token of column j2, vector by vector: its own partial (computed here)
      // plus the peer's (polled). a + b == b + a exactly, so the sum has the bits of the two-shot's
      // rank-ordered one. The row goes to residual_out and to the peer; it is normed below.
      const int t = p.rank * C + j2;
      if (t < T) {
        uint4* peer_slot = reinterpret_cast<uint4*>(my_buffer + ((long long)peer * C + j2) * H);
        uint4* residual_out = reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H);
        uint4* peer_row = reinterpret_cast<uint4*>(peer_buffer + lay.gather_base + (long long)t * H);
        const uint4* residual_in =
            reinterpret_cast<const uint4*>(static_cast<const D*>(p.residual_in) + (long long)t * H);
        const auto reduce = [&](int v, uint4 own, uint4 from_peer, uint4 residual) {
          float s[8], x[8];
          Vec<D>::to_float(own, s);
          Vec<D>::to_float(from_peer, x);
          __stcs(peer_slot + v, sentinel);  // read once: clean again for the call that reuses this buffer
#pragma unroll
          for (int i = 0; i < 8; ++i) s[i] += x[i];
          Vec<D>::to_float(residual, x);
#pragma unroll
          for (int i = 0; i < 8; ++i) s[i] += x[i];
          const uint4 res = without_sentinel(Vec<D>::from_float(s));  // as the peer receives it
          residual_out[v] = res;
          // after an expired wait, send nothing: the peer must time out too, not take this as the sum
          if (!deadline.expired) peer_row[v] = res;
        };
        if constexpr (kRowStages > 0) {
          // The whole row at once: every load of the peer's vectors in flight together (one memory
          // latency, not one per vector), and residual_in from the ring (its row comes after the
          // partials: copied while they were added).
          uint4 own[kMaxVecPerThread], from_peer[kMaxVecPerThread];
          partial_row(p, ring, t, own, bad_rows);
          wait_and_reduce<D, 1, false>(reinterpret_cast<const D*>(peer_slot), 0, 0, vpt, t, from_peer, deadline, p,
                                       kPhaseReduceScatter);
          const uint4* residual_row = ring.wait_row(p);
#pragma unroll
          for (int r = 0; r < kMaxVecPerThread; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (r < vpt && v < nvec) reduce(v, own[r], from_peer[r], residual_row[v]);
          }
          ring.release_row(p);
        } else {
#pragma unroll 1
          for (int r = 0; r < vpt; ++r) {
            const int v = r * blockDim.x + threadIdx.x;
            if (v >= nvec) continue;
            const uint4 own = partial_vector<D, false, kRoutes, kSharedFirst, /*kStreaming=*/true>(p, t, v, bad_rows);
            const uint4 from_peer = wait_vector(peer_slot + v, deadline, p, kPhaseReduceScatter);
            reduce(v, own, from_peer, load_streaming(residual_in + v));
          }
        }
      }
    }
    // phase 3: RMSNorm and quantization of two rows: this rank's token of column j2 (from
    // residual_out, just written by these same threads) and the peer's token of column j3 (as the
    // peer sent it; it also goes to residual_out). One loop, so norm_row is inlined once.
#pragma unroll 1
    for (int from_peer = 0; from_peer < 2; ++from_peer) {
      const bool active = from_peer ? k >= 2 : k >= 1 && k - 1 < columns;
      const int t = from_peer ? peer * C + j3 : p.rank * C + j2;
      if (!active || t >= T) continue;  // the same for the whole block: norm_row's barriers stay aligned
      uint4* residual_out = reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H);
      uint4 res[kMaxVecPerThread];
      if (from_peer) {
        uint4* row = reinterpret_cast<uint4*>(my_buffer + lay.gather_base + (long long)t * H);
        wait_and_reduce<D, 1, false>(reinterpret_cast<D*>(row), 0, 0, vpt, t, res, deadline, p, kPhaseAllGather);
#pragma unroll
        for (int r = 0; r < kMaxVecPerThread; ++r) {
          const int v = r * blockDim.x + threadIdx.x;
          if (r >= vpt || v >= nvec) continue;
          __stcs(row + v, sentinel);  // read once: clean again
          __stcs(residual_out + v, res[r]);  // not read again here
        }
      } else {
#pragma unroll
        for (int r = 0; r < kMaxVecPerThread; ++r) {
          const int v = r * blockDim.x + threadIdx.x;
          res[r] = r < vpt && v < nvec ? residual_out[v] : make_uint4(0, 0, 0, 0);
        }
      }
      norm_row<D, P, /*overlap_quant_rounds=*/true, /*fewest_quant_instructions=*/(kRowStages > 0),
               /*streaming_stores=*/true>(p, t, res);
    }
  }
}

}  // namespace moe_ar
