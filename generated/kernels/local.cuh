// World size 1 (the local regimes): nothing is exchanged, so nothing is rounded before the residual add.
// Each token row is finalized in fp32 (the same loads and the same order of additions as an
// exchanging rank's partial, finalize.cuh), residual_in is added in fp32, the sum is rounded once to
// residual_out, then the row epilogue (norm.cuh: RMSNorm, quant) runs as in the other regimes.
// No buffers, no peers, no sentinel, no deadline, no poisoned output and no call counter: the only
// state word used is kBadRows, the count of skipped out-of-range routes (dispatch check() reads it).
//
// Two layouts, one program each (generator/spec.py): kLocal for few tokens issues every load of a
// row before using any (latency; in the program for every shape above kAllLoadsMaxTokens tokens four
// routes at a time, the indices read first); kLocalStreaming for many tokens (bandwidth) keeps two
// blocks on a multiprocessor, each loading its rows a few routes at a time (local_row_batched), so
// that one block's loads are in flight while the other normalizes and quantizes.
#pragma once
#include "call.cuh"
#include "finalize.cuh"
#include "fp8.cuh"
#include "lamport.cuh"
#include "norm.cuh"
#include "nvfp4.cuh"
#include "params.cuh"
#include "shape.cuh"
#include "vector.cuh"

namespace moe_ar {

// s = (+0.0 + partial) + residual, the residual-add of both layouts: the sum starts from +0.0, as the
// exchanges' does (a zero sum is +0.0). Correctly rounded adds, never contracted or folded.
__device__ __forceinline__ void add_residual_from_zero(float (&s)[8], const float (&residual)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = __fadd_rn(__fadd_rn(s[i], 0.f), residual[i]);
}

// The latency layout's row: every load of the thread's part of row t is issued before any is used
// (the residual and shared rows, then the routes' indices and weights, then every route's row of each
// of its kVec vectors): one memory latency after the indices, not one per batch of routes and vector.
// The additions are partial_f32's, in its order. For top_k <= kMaxRoutes and vec_per_thread <= kVec.
template <typename D, int kVec, int kMaxRoutes, bool kStore = true>
__device__ __forceinline__ void local_row_all_loads(const Params& p, int t, unsigned& bad_rows,
                                                    uint4 (&res)[kMaxVecPerThread],
                                                    RowPlace place = block_row_place()) {
  const int H = row_hidden(p), K = row_top_k(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  const D* residual = static_cast<const D*>(p.residual_in) + (long long)t * H;
  const D* shared = static_cast<const D*>(p.shared_in) + (long long)t * H;
  uint4 resid[kVec], shared_row[kVec], rows[kVec][kMaxRoutes];
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * place.threads + place.thread;
    const bool valid = r < vpt && v < nvec;
    resid[r] = valid ? *reinterpret_cast<const uint4*>(residual + v * kElemsPerVec) : make_uint4(0, 0, 0, 0);
    shared_row[r] = valid && p.shared_in != nullptr ? *reinterpret_cast<const uint4*>(shared + v * kElemsPerVec)
                                                    : make_uint4(0, 0, 0, 0);
  }
  int row[kMaxRoutes];  // >= 0: the route's row; -1: dropped; -2: out of range (skipped and counted)
  float scale[kMaxRoutes];
  const int* idx = p.expanded_idx + (long long)t * K;
#pragma unroll
  for (int k = 0; k < kMaxRoutes; ++k) {
    const int given = k < K ? idx[k] : -1;
    const bool in_range = given >= 0 && given < p.rows;
    float s = 0.f;
    if (in_range) {
      if (row_scale_kind(p) == 0) s = 1.f;
      else if (row_scale_kind(p) == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
      else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
    }
    scale[k] = s;
    row[k] = in_range ? given : given >= p.rows ? -2 : -1;
  }
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * place.threads + place.thread;
    const bool valid = r < vpt && v < nvec;
#pragma unroll
    for (int k = 0; k < kMaxRoutes; ++k) {
      rows[r][k] = valid && row[k] >= 0
                       ? *reinterpret_cast<const uint4*>(static_cast<const D*>(p.allreduce_in) +
                                                         (long long)row[k] * H + v * kElemsPerVec)
                       : make_uint4(0, 0, 0, 0);
      if (valid && row[k] == -2) ++bad_rows;
    }
  }
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * place.threads + place.thread;
    res[r] = make_uint4(0, 0, 0, 0);
    if (r >= vpt || v >= nvec) continue;
    float acc[8], x[8], s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxRoutes; ++k) {
      Vec<D>::to_float(rows[r][k], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(scale[k], x[i], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = acc[i] * p.routed_scaling_factor;
    if (p.shared_in != nullptr) {
      Vec<D>::to_float(shared_row[r], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += x[i];
    }
    Vec<D>::to_float(resid[r], x);
    add_residual_from_zero(s, x);
    res[r] = Vec<D>::from_float(s);
    if (kStore) reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H)[v] = res[r];
  }
}

// residual_out[t] from res, the thread's vectors of the row (a row whose store comes after its norm).
template <typename D>
__device__ __forceinline__ void store_residual_row(const Params& p, int t, const uint4 (&res)[kMaxVecPerThread],
                                                   RowPlace place) {
  const int nvec = row_hidden(p) / kElemsPerVec, vpt = row_vec_per_thread(p);
  uint4* out = reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * row_hidden(p));
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * place.threads + place.thread;
    if (r < vpt && v < nvec) out[v] = res[r];
  }
}

// The pieces of the latency layout's four-routes path (local_row_routes_given; local_row_batched
// below is the streaming layout's own copy, kept as its SASS was measured). The residual and shared
// rows of the thread's kVec vectors (zero past the row), acc zeroed.
template <typename D, int kVec>
__device__ __forceinline__ void load_residual_and_shared(const Params& p, int t, uint4 (&resid)[kVec],
                                                         uint4 (&shared_row)[kVec], float (&acc)[kVec][8]) {
  const int H = row_hidden(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  const D* residual = static_cast<const D*>(p.residual_in) + (long long)t * H;
  const D* shared = static_cast<const D*>(p.shared_in) + (long long)t * H;
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * row_threads() + threadIdx.x;
    const bool valid = r < vpt && v < nvec;
    resid[r] = valid ? *reinterpret_cast<const uint4*>(residual + v * kElemsPerVec) : make_uint4(0, 0, 0, 0);
    shared_row[r] = valid && p.shared_in != nullptr ? *reinterpret_cast<const uint4*>(shared + v * kElemsPerVec)
                                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  }
}

// Routes k0 .. k0 + kBatch - 1 of token t (given: their expanded_idx entries, -1 past top_k): each
// route's kVec vectors loaded together, then added to acc in route order (partial_f32's additions).
template <typename D, int kVec, int kBatch>
__device__ __forceinline__ void add_routes(const Params& p, int t, int k0, const int (&given)[kBatch],
                                           float (&acc)[kVec][8], unsigned& bad_rows) {
  const int H = row_hidden(p), K = row_top_k(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  int row[kBatch];  // >= 0: the route's row; -1: dropped or past top_k; -2: out of range (skipped, counted)
  float scale[kBatch];
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int k = k0 + j;
    const bool in_range = given[j] >= 0 && given[j] < p.rows;
    float s = 0.f;
    if (in_range) {
      if (row_scale_kind(p) == 0) s = 1.f;
      else if (row_scale_kind(p) == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
      else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
    }
    scale[j] = s;
    row[j] = in_range ? given[j] : given[j] >= p.rows ? -2 : -1;
  }
  uint4 rows[kVec][kBatch];
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * row_threads() + threadIdx.x;
    const bool valid = r < vpt && v < nvec;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      rows[r][j] = valid && row[j] >= 0 ? *reinterpret_cast<const uint4*>(static_cast<const D*>(p.allreduce_in) +
                                                                           (long long)row[j] * H + v * kElemsPerVec)
                                        : make_uint4(0, 0, 0, 0);
      if (valid && row[j] == -2) ++bad_rows;
    }
  }
#pragma unroll
  for (int r = 0; r < kVec; ++r)
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      float x[8];
      Vec<D>::to_float(rows[r][j], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(scale[j], x[i], acc[r][i]);
    }
}

// residual_out[t] = (+0.0 + routed_scaling_factor * acc + shared) + residual, stored, and held in res.
template <typename D, int kVec>
__device__ __forceinline__ void store_residual_out(const Params& p, int t, const uint4 (&resid)[kVec],
                                                   const uint4 (&shared_row)[kVec], const float (&acc)[kVec][8],
                                                   uint4 (&res)[kMaxVecPerThread]) {
  const int nvec = row_hidden(p) / kElemsPerVec, vpt = row_vec_per_thread(p);
  D* residual_out = static_cast<D*>(p.residual_out) + (long long)t * row_hidden(p);
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    res[r] = make_uint4(0, 0, 0, 0);
    const int v = r * row_threads() + threadIdx.x;
    if (r >= kVec || r >= vpt || v >= nvec) continue;
    float s[8], x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = acc[r][i] * p.routed_scaling_factor;
    if (p.shared_in != nullptr) {
      Vec<D>::to_float(shared_row[r], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += x[i];
    }
    Vec<D>::to_float(resid[r], x);
    add_residual_from_zero(s, x);
    res[r] = Vec<D>::from_float(s);
    reinterpret_cast<uint4*>(residual_out)[v] = res[r];
  }
}

// The batched row: kBatch routes at a time, each route's kVec vectors of the thread loaded together
// (kVec * kBatch loads in flight), then added. Under a register bound of two blocks a multiprocessor
// one block's epilogue runs under the other's loads. The additions are partial_f32's, in its order,
// then the residual's: the same bits as the other paths.
template <typename D, int kVec, int kBatch>
__device__ __forceinline__ void local_row_batched(const Params& p, int t, unsigned& bad_rows,
                                                  uint4 (&res)[kMaxVecPerThread]) {
  static_assert(kVec <= kMaxVecPerThread, "kVec: at most kMaxVecPerThread vectors a thread");
  const int H = row_hidden(p), K = row_top_k(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  const D* residual = static_cast<const D*>(p.residual_in) + (long long)t * H;
  const D* shared = static_cast<const D*>(p.shared_in) + (long long)t * H;
  uint4 resid[kVec], shared_row[kVec];
  float acc[kVec][8];
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    const int v = r * row_threads() + threadIdx.x;
    const bool valid = r < vpt && v < nvec;
    resid[r] = valid ? *reinterpret_cast<const uint4*>(residual + v * kElemsPerVec) : make_uint4(0, 0, 0, 0);
    shared_row[r] = valid && p.shared_in != nullptr ? *reinterpret_cast<const uint4*>(shared + v * kElemsPerVec)
                                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  }
  const int* idx = p.expanded_idx + (long long)t * K;
  for (int k0 = 0; k0 < K; k0 += kBatch) {
    int row[kBatch];  // >= 0: the route's row; -1: dropped or past top_k; -2: out of range (skipped, counted)
    float scale[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int k = k0 + j;
      const int given = k < K ? idx[k] : -1;
      const bool in_range = given >= 0 && given < p.rows;
      float s = 0.f;
      if (in_range) {
        if (row_scale_kind(p) == 0) s = 1.f;
        else if (row_scale_kind(p) == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
        else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
      }
      scale[j] = s;
      row[j] = in_range ? given : given >= p.rows ? -2 : -1;
    }
    // each route's pointer to this thread's first vector once; its later vectors a block stride on
    const char* route_vecs[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      route_vecs[j] = reinterpret_cast<const char*>(static_cast<const D*>(p.allreduce_in) + (long long)max(row[j], 0) * H) +
                      threadIdx.x * 16u;
    const unsigned stride = row_threads() * 16u;
    uint4 rows[kVec][kBatch];
#pragma unroll
    for (int r = 0; r < kVec; ++r) {
      const int v = r * row_threads() + threadIdx.x;
      const bool valid = r < vpt && v < nvec;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        rows[r][j] = valid && row[j] >= 0 ? *reinterpret_cast<const uint4*>(route_vecs[j] + r * stride)
                                          : make_uint4(0, 0, 0, 0);
        if (valid && row[j] == -2) ++bad_rows;
      }
    }
#pragma unroll
    for (int r = 0; r < kVec; ++r)
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        float x[8];
        Vec<D>::to_float(rows[r][j], x);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(scale[j], x[i], acc[r][i]);
      }
  }
  D* residual_out = static_cast<D*>(p.residual_out) + (long long)t * H;
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    res[r] = make_uint4(0, 0, 0, 0);
    const int v = r * row_threads() + threadIdx.x;
    if (r >= kVec || r >= vpt || v >= nvec) continue;
    float s[8], x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = acc[r][i] * p.routed_scaling_factor;
    if (p.shared_in != nullptr) {
      Vec<D>::to_float(shared_row[r], x);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += x[i];
    }
    Vec<D>::to_float(resid[r], x);
    add_residual_from_zero(s, x);
    res[r] = Vec<D>::from_float(s);
    reinterpret_cast<uint4*>(residual_out)[v] = res[r];
  }
}

// The expanded_idx entries of token t (-1 past top_k, and for t past the last token); top_k <= 8.
__device__ __forceinline__ void load_routes(const Params& p, int t, int (&routes)[8]) {
  const int* idx = p.expanded_idx + (long long)t * row_top_k(p);
#pragma unroll
  for (int k = 0; k < 8; ++k) routes[k] = t < p.tokens && k < row_top_k(p) ? idx[k] : -1;
}

// The batched row with the token's route indices already read (routes, top_k <= 8): no memory trip
// for the indices between the batches. The same additions, the same bits.
template <typename D, int kVec, int kBatch>
__device__ __forceinline__ void local_row_routes_given(const Params& p, int t, const int (&routes)[8],
                                                       unsigned& bad_rows, uint4 (&res)[kMaxVecPerThread]) {
  uint4 resid[kVec], shared_row[kVec];
  float acc[kVec][8];
  load_residual_and_shared<D, kVec>(p, t, resid, shared_row, acc);
#pragma unroll
  for (int k0 = 0; k0 < 8; k0 += kBatch) {
    if (k0 >= row_top_k(p)) break;
    int given[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) given[j] = routes[k0 + j];
    add_routes<D, kVec, kBatch>(p, t, k0, given, acc, bad_rows);
  }
  store_residual_out<D, kVec>(p, t, resid, shared_row, acc, res);
}

// Any row split and top_k: the vectors one after the other, kRoutes routes of a vector at a time
// (finalize.cuh's partial_f32).
template <typename D, int kRoutes, bool kSharedFirst>
__device__ __forceinline__ void local_row_by_vector(const Params& p, int t, unsigned& bad_rows,
                                                    uint4 (&res)[kMaxVecPerThread]) {
  const int H = row_hidden(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
#pragma unroll
  for (int r = 0; r < kMaxVecPerThread; ++r) {
    const int v = r * row_threads() + threadIdx.x;
    res[r] = make_uint4(0, 0, 0, 0);
    if (r >= vpt || v >= nvec) continue;
    float s[8], x[8];
    const PartialF32 part = partial_f32<D, kRoutes, kSharedFirst>(p, t, v, bad_rows);
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = part.x[i];
    // residual_in[t] is read before residual_out[t] is written (in place)
    Vec<D>::to_float(*reinterpret_cast<const uint4*>(static_cast<const D*>(p.residual_in) + (long long)t * H +
                                                     v * kElemsPerVec), x);
    add_residual_from_zero(s, x);
    res[r] = Vec<D>::from_float(s);
    reinterpret_cast<uint4*>(static_cast<D*>(p.residual_out) + (long long)t * H)[v] = res[r];
  }
}

// Blocks stride over token rows (a grid of at most the co-resident blocks); a row is spread over the
// block's threads, vec_per_thread 16-byte vectors a thread, as in the exchanges' last phase.
template <typename D, Profile P, Regime R, int kRoutes, bool kSharedFirst>
__device__ __forceinline__ void run_local(const Params& p) {
  wait_for_previous_kernel();  // inputs and outputs belong to the previous kernel until here
  const int T = p.tokens;
  // The next kernel's griddepcontrol.wait still waits for this whole grid to finish and its writes to
  // be visible, and this grid is all resident at once (dispatch sizes it so): letting the next kernel
  // launch now only lets its blocks take the multiprocessors' free room early. The streaming layout
  // does so only where its grid fills every block slot (T > grid): below that a next call placed in
  // the free slots beside it ran slower with warm L2 (bench_results/world_size_1/stream_pdl/); its
  // blocks' exit lets the next kernel launch then.
  if (R != Regime::kLocalStreaming || T > (int)gridDim.x) allow_next_kernel();
  unsigned bad_rows = 0;
  if (P == Profile::kNvfp4) fill_nvfp4_reciprocals(p);  // read after the first row's sum-of-squares barriers
  if (P == Profile::kNvfp4) zero_scale_padding(p);
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  // The latency layout's fast path: the row split of few tokens (2 vectors a thread) and top_k <= 8;
  // every load of a row at once up to kAllLoadsMaxTokens, in a shape build up to the tokens it serves
  // (shape_constants.MAX_TOKENS), else four routes at a time, the token's indices read first. A build
  // keeps the four-routes path: without it ptxas gives the kernel fewer registers and splits the row's
  // loads in two batches, a memory latency more (bench_results/world_size_1/all_loads/).
  const bool fast_path = R == Regime::kLocal && row_vec_per_thread(p) <= 2 && row_top_k(p) <= 8;
#ifdef MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS
  const bool all_loads = fast_path && T <= MOE_AR_FIXED_ALL_LOADS_MAX_TOKENS;
#else
  const bool all_loads = fast_path && T <= kAllLoadsMaxTokens;
#endif
  const bool routes_first = fast_path && !all_loads;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    uint4 res[kMaxVecPerThread];  // residual_out, in the dtype
    if (R == Regime::kLocalStreaming) {
      local_row_batched<D, kMaxVecPerThread, kRoutes>(p, t, bad_rows, res);
    } else if (routes_first) {
      int routes[8];
      load_routes(p, t, routes);
      local_row_routes_given<D, 2, 4>(p, t, routes, bad_rows, res);
    } else if (all_loads) {
      local_row_all_loads<D, 2, 8>(p, t, bad_rows, res);
    } else {
      local_row_by_vector<D, kRoutes, kSharedFirst>(p, t, bad_rows, res);
    }
    // the latency layouts sum squares in one order (their cluster layout splits a row otherwise); the
    // streaming one in block_sum's, which measured faster there for FP8 group-128
    // (bench_results/world_size_1/cluster_one_vector/)
    norm_row<D, P, false, true, false, false, /*kOneOrderSum=*/R == Regime::kLocal>(p, t, res);
  }
  // kBadRows counts a skipped route once a 16-byte vector
  if (bad_rows) atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows);
}

// The latency layout over a cluster (few tokens; a second entry of the local programs, launched with
// a cluster of C blocks a token, the grid T * C): block c holds the row's threads c * blockDim.x to
// (c + 1) * blockDim.x - 1 of the one-block layout's all-loads row (the same split), so every load,
// addition and sum is that layout's: the same bits, the row's loads spread over C multiprocessors.
template <typename D, Profile P>
__device__ __forceinline__ void run_local_cluster(const Params& p) {
  cluster_sum_init();
  cluster_arrive_started();  // cluster_row_sum_of_squares waits for every block of the cluster to have started
  wait_for_previous_kernel();  // inputs and outputs belong to the previous kernel until here
  allow_next_kernel();  // as run_local: the grid is all resident at once
  unsigned bad_rows = 0;
  if (P == Profile::kNvfp4) fill_nvfp4_reciprocals(p);  // read after the sum of squares' barriers
  if (P == Profile::kNvfp4) zero_scale_padding(p);
  if (P == Profile::kFp8Group128 && (p.quant_flags & kScalesColumnMajor)) zero_fp8_scale_padding(p);
  const unsigned C = cluster_blocks();
  const int thread = (int)(block_in_cluster() * blockDim.x + threadIdx.x);
#ifdef MOE_AR_FIXED_ROW_THREADS  // a shape build (shape.cuh): the launch makes C * blockDim.x the row's threads
  // No __builtin_assume(thread < MOE_AR_FIXED_ROW_THREADS): where the row fills the threads exactly,
  // that let ptxas drop the row check and then interleave the row's loads with their additions, a
  // few in flight instead of all (bench_results/world_size_1/cluster_one_vector/).
  const RowPlace place{thread, MOE_AR_FIXED_ROW_THREADS};
#else
  const RowPlace place{thread, (int)(C * blockDim.x)};
#endif
  const int t = (int)(blockIdx.x / C);
  uint4 res[kMaxVecPerThread];  // residual_out, in the dtype
  // plain stores residual_out after norm_out: faster at the cluster layout's tokens, where the quantized
  // profiles are not (bench_results/world_size_1/late_store/)
  constexpr bool kResidualLast = P == Profile::kPlain;
  local_row_all_loads<D, 2, 8, !kResidualLast>(p, t, bad_rows, res, place);
  norm_row<D, P, false, true, false, /*kClusterRow=*/true>(p, t, res, place);
  if (kResidualLast) store_residual_row<D>(p, t, res, place);
  if (bad_rows) atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows);
}

}  // namespace moe_ar
