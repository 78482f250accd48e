// MoE finalize + all-reduce over NVLink + residual add + RMSNorm (+ NVFP4 or FP8), one kernel per rank.
//
// Every program (generated/programs/) includes this file and instantiates moe_ar::run (run.cuh) for
// one (dtype, world size, output profile, regime, shared-expert prefetch). World size 1 exchanges
// nothing: its two regimes (local.cuh) use none of the exchange below. The loader compiles a
// program with its includes inlined, each header once, in this order (moe_ar_common/manifest_reader.py).
//
// Exchange: Lamport (lamport.cuh). Every rank owns three rotating buffers in its own memory; peers
// store their payload straight into them over NVLink and the owner polls until it has arrived.
// Call n writes and reads buffer n % 3 and clears the buffer of call n - 1, which no peer writes
// again before call n + 2 (a peer cannot finish call n + 1 before this rank has sent its call n + 1
// data, so the clear is always done first).
//
// All state (call counter, extent written into each buffer) lives in this rank's device memory
// (call.cuh), so a captured CUDA graph replays correctly, and every regime shares it, so T may cross
// regime boundaries between calls. Every wait on a peer has a deadline; after a timeout the outputs
// are poisoned (poison.cuh) until the workspace is reset.
//
// The compiled code follows the order of the definitions (it lays out static shared memory and the
// constants in global memory in that order), so the include order below is part of the code.
#pragma once
#include "params.cuh"     // generated: launch limits and the Params struct (generator/abi.py)
#include "vector.cuh"     // 16-byte vectors: conversions, loads
#include "call.cuh"       // profiles and regimes, state and error words, buffer layout, bookkeeping
#include "lamport.cuh"    // sentinel, polling waits, deadlines
#include "finalize.cuh"   // this rank's partial: the routed experts' weighted sum + shared expert
#include "block_sum.cuh"  // the sum of squares of the RMSNorm
#include "shape.cuh"      // the call's shape: Params fields, or constants in a shape build
#include "fp8.cuh"        // FP8 quantization
#include "nvfp4.cuh"      // NVFP4 quantization
#include "norm.cuh"       // the row epilogue: RMSNorm, then the quantized output
#include "poison.cuh"     // the poisoned output after a timeout
#include "row_ring.cuh"   // the pipelined two-shot's row ring in shared memory
#include "pipelined.cuh"  // the pipelined two-shot
#include "local.cuh"      // world size 1: nothing exchanged
#include "run.cuh"        // the kernel body: one-shot, two-shot, early two-shot (and the entry of the others)
