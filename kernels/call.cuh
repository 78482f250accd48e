// One call of the kernel: what a program instantiates, the state words a rank keeps in its device
// memory from call to call, the host-mapped error words, where a call lies in a rotating buffer, and
// the bookkeeping that ends a call.
#pragma once
#include "params.cuh"
#include "vector.cuh"

namespace moe_ar {

// The output profile and the regime a program is instantiated for (generator/spec.py spells them).
enum class Profile { kPlain, kNvfp4, kFp8Group128, kFp8Tensor };
// kLocal, kLocalStreaming: world size 1 (local.cuh). kTwoShotPipelined serves both pipelined rungs of
// the ladder (twoshot_pipelined_loads, twoshot_pipelined): one exchange; the program's row_stages picks
// how the partials' rows arrive (0: into registers, > 0: through the row ring).
enum class Regime { kOneShot, kTwoShot, kTwoShotEarly, kTwoShotPipelined, kLocal, kLocalStreaming };

// Device state words of one rank (Params.state), the host-mapped error words (Params.error, read by the
// host without a synchronization), error codes and phases: enums StateWord, ErrorWord, ErrorCode and
// Phase of params.cuh (generator/abi.py SHARED_ENUMS, which the runtime reads from the manifest).
// kExtent0 + b: the extent the last call wrote into buffer b, in 16-byte vectors (H % 16 == 0 makes
// it exact; 2^32 vectors are 64 GiB a buffer, and dispatch/workspace.py check_sizes refuses more).
// kPoisoned: 0, or 1 + the call counter of the call in which a wait of this rank timed out (that
// call's own reads of it then do not count as poisoned, so the word is block-uniform without a barrier).
// kBadRows (64-bit, words 6 and 7) counts 16-byte loads of routes skipped because their row was >= R
// (read by dispatch.check()).

// The state words are written by the previous call's last block, on some other SM, and with PDL this
// kernel starts while that call still runs: read them from L2, never from a possibly stale L1 line.
__device__ __forceinline__ unsigned load_state(const unsigned* p) { return __ldcg(p); }
// Programmatic dependent launch: both are no-ops when the launch did not ask for it.
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_next_kernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Rank q's buffer base. Selected with compile-time indices: a run-time index into the kernel
// argument would copy the whole argument to local memory.
template <int W>
__device__ __forceinline__ void* buffer_of(const Params& p, int q) {
  void* b = p.peer_buffers[0];
#pragma unroll
  for (int i = 1; i < W; ++i)
    if (q == i) b = p.peer_buffers[i];
  return b;
}

// The layout of one call in a rotating buffer (elements of dtype): one-shot, a slot [rank][t] of every
// token for every rank; two-shot, a slot [rank][j] for each of the owner's C tokens, then the
// all-gather rows [t].
struct Layout {
  int tokens_per_owner;  // two-shot: C = ceil(T / W); one-shot: T
  long long gather_base; // two-shot: start of the all-gather rows; one-shot: unused
  long long extent;      // elements written into each rank's buffer by this call
};

template <Regime R, int W>
__device__ __forceinline__ Layout layout_of(int T, int H) {
  Layout l;
  if (R == Regime::kOneShot) {
    l.tokens_per_owner = T;
    l.gather_base = 0;
    l.extent = (long long)W * T * H;
  } else {
    l.tokens_per_owner = (T + W - 1) / W;
    l.gather_base = (long long)W * l.tokens_per_owner * H;
    l.extent = l.gather_base + (long long)T * H;
  }
  return l;
}

// Bookkeeping: every block counts itself in (kDoneBlocks) once all of its threads have used the
// state words they read at its start; the block that counts in last advances the state at its end.
// The one-shot counts in right after the clear (its extent is the last state word it uses), so the
// count's round trip overlaps the wait for the peers instead of ending the call. The two-shots count
// in at their end: the pipelined one uses the extent until its last column, and the others, holding
// the count through their phases, spilled at world size 8 (NVFP4). No fence: the last block reads
// nothing the other blocks wrote, and the next call reads the state only after this grid has
// completed (stream order, or griddepcontrol.wait under PDL). bench_results/oneshot/ (count_in, fences).
__device__ __forceinline__ unsigned count_in(const Params& p) {
  __syncthreads();  // every thread of the block is past its use of the state words
  return threadIdx.x == 0 ? atomicAdd(p.state + kDoneBlocks, 1u) : 0u;
}
// The same, at the end of a call: also ORs gave_up over the block (one barrier for both).
__device__ __forceinline__ unsigned count_in(const Params& p, bool& gave_up) {
  gave_up = __syncthreads_or(gave_up);
  return threadIdx.x == 0 ? atomicAdd(p.state + kDoneBlocks, 1u) : 0u;
}
// At the end of a two-shot: whether a wait of this call has timed out so far (kPoisoned), surely so in a
// thread that gave up itself (it wrote the word). ORed over the block, it makes every block that gave up,
// and any that ends after another one did, write the poisoned output over all of its rows. (In the
// two-shots, cheaper in registers than keeping the thread's Deadline::expired live to the end.)
__device__ __forceinline__ bool timed_out_in_this_call(const Params& p, unsigned call) {
  return load_state(p.state + kPoisoned) == call + 1;
}

// extent: elements this call wrote into its buffer (a multiple of 8). bad_rows * bad_row_unit: 16-byte
// loads this thread skipped. The counter wraps at 0xFFFFFFFF, a multiple of 3, so that call % 3 keeps
// rotating the buffers in order across the wrap.
__device__ __forceinline__ void finish_call(const Params& p, unsigned counted_before, unsigned call, int cur, int prev,
                                            long long extent, unsigned bad_rows, unsigned bad_row_unit = 1) {
  if (bad_rows)
    atomicAdd(reinterpret_cast<unsigned long long*>(p.state + kBadRows), (unsigned long long)bad_rows * bad_row_unit);
  if (threadIdx.x == 0 && counted_before == gridDim.x - 1) {  // this block counted in last
    p.state[kExtent0 + cur] = (unsigned)(extent / kElemsPerVec);
    p.state[kExtent0 + prev] = 0;
    p.state[kCallCounter] = call == 0xFFFFFFFEu ? 0u : call + 1;
    p.state[kDoneBlocks] = 0;
  }
}

}  // namespace moe_ar
