// GENERATED FILE, DO NOT EDIT: written by gen-programs, generator/ from templates/params.cuh.j2.
// To change it, edit the template or generator/ and run `gen-programs`.
// Launch limits and the kernel's only argument, from generator/abi.py; the manifest carries the same
// plan, so the runtime fills a matching ctypes structure.
#pragma once

namespace moe_ar {

constexpr int kMaxWorldSize = 16;
constexpr int kMaxVecPerThread = 4;  // 16-byte vectors of a row one thread holds
constexpr int kMaxThreads = 512;              // threads of a block
constexpr int kAllLoadsMaxTokens = 16;  // world size 1's latency layout: every load at once up to here

// a rank's device state words (Params.state), 32-bit each
enum StateWord {
  kCallCounter = 0,  // the call counter (buffers rotate by call % 3)
  kExtent0 = 1,  // kExtent0 + b: the extent the last call wrote into buffer b, in 16-byte vectors
  kDoneBlocks = 4,  // blocks of this call done (the last one ends the call)
  kPoisoned = 5,  // 0, or 1 + the call counter of the call in which a wait timed out
  kBadRows = 6,  // skipped out-of-range route loads, 64-bit: words 6 (low) and 7 (high)
  kStateWords = 8,  // the number of state words
};
// the host-mapped error words (Params.error)
enum ErrorWord {
  kErrCode = 0,  // an ErrorCode
  kErrPhase = 1,  // the Phase the wait timed out in
  kErrRank = 2,  // the rank that timed out
  kErrorWords = 4,  // the number of error words (one spare)
};
// what the error words report
enum ErrorCode {
  kErrNone = 0,  // no error
  kErrTimeout = 1,  // a wait for a peer timed out
};
// where a call waits for its peers
enum Phase {
  kPhaseNone = 0,  // none
  kPhaseReduceScatter = 1,  // reduce-scatter (waiting for peers' partials)
  kPhaseAllGather = 2,  // all-gather (waiting for the owners' residual_out rows)
  kPhaseOneShot = 3,  // one-shot (waiting for peers' partials)
};
// bits of Params.quant_flags (profile fp8_group128)
enum QuantFlag {
  kScalesColumnMajor = 1,  // scale_out column-major
  kScalesPow2 = 2,  // power-of-two scales
};

// Passed by value; fields ordered by size, so that C and ctypes agree on padding.
struct Params {
  const void* allreduce_in;  // [R, H] dtype, permuted expert rows (this rank's partials)
  const int* expanded_idx;  // [T, K] int32 row of allreduce_in per (token, route); < 0 = dropped
  const void* expert_scale;  // [T, K] dtype or fp32 router weights, or null (= 1)
  const void* shared_in;  // [T, H] dtype shared-expert partial, or null
  const void* residual_in;  // [T, H] dtype
  const void* norm_weight;  // [H] dtype RMSNorm gamma
  const float* quant_scale;  // [1] fp32: NVFP4 global scale (nvfp4), FP8 per-tensor scale (fp8_tensor), else null
  void* norm_out;  // [T, H] dtype
  void* residual_out;  // [T, H] dtype
  void* quant_out;  // [T, H/2] uint8 packed E2M1 (nvfp4); [T, H] FP8 E4M3 (fp8_*); else null
  void* scale_out;  // swizzled 128x4 E4M3 scales (nvfp4); fp32 group scales (fp8_group128); else null
  void* peer_buffers[16];  // Lamport buffer base of every rank (3 rotating buffers each), by rank
  unsigned* state;  // this rank's device state words (call counter, extents, done counter, poisoned, skipped loads)
  unsigned* error;  // host-mapped error words: code, phase, rank, bad-index count
  long long buffer_elems;  // elements of dtype in one rotating buffer
  unsigned long long timeout_ns;  // deadline for any wait on a peer, in ns (0 = none)
  int tokens;  // T
  int hidden;  // H
  int top_k;  // K
  int rows;  // R, rows of allreduce_in (indices >= R are skipped and counted)
  int rank;  // this rank
  int scale_kind;  // 0: no expert_scale, 1: fp32, 2: dtype
  int vec_per_thread;  // 16-byte vectors of a row held by one thread
  int quant_flags;  // fp8_group128: 1 = column-major scales [H/128, roundup(T, 4)], 2 = power-of-two scales
  int fault_stop_after;  // fault injection for tests: > 0 sends only that many phase-1 units, then stops; 0 normally
  float routed_scaling_factor;  // multiplies the routed sum
  float eps;  // RMSNorm epsilon
  float weight_bias;  // 0, or 1 for (1 + gamma)
};

}  // namespace moe_ar
