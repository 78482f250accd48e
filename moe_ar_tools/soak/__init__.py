"""Soak: many calls in an emulated world, random token counts across every regime, every output checked.

    moe-ar-soak --world-size 4 --calls 100000 --time-budget-s 300 --out soak-ws4.json
    moe-ar-soak --world-size 2 --devices 0,1 --calls 100000 --out soak-ws2-2gpu.json
    (or python -m moe_ar_tools.soak ...)

Every call draws a token count T (log-uniform over 1..max_tokens, near a regime boundary of the
selection table, special values, or uniform), top_k, padded and dropped routes, expert scales
(none, float32, dtype), a shared expert (none, every rank, rank 0 only), the output profile
(plain or NVFP4, the global scale a device tensor), PDL on or off, and either an eager
`world.run` or the replay of a CUDA graph captured once per (T bucket, options) with static
buffers refilled with fresh random values before each replay. Graphs are captured only in
single-device worlds (EmulatedWorld.run's contract); a world spread over GPUs runs eager calls
only, and the JSON says so.

Inputs live in preallocated buffers of max_tokens rows; each call refills the rows it uses with
torch's GPU generator (no CPU work per element), poisons its outputs (NaN, 0xAB bytes) and, on
the GPU, right behind the kernels:

* residual_out of rank 0 against the precision contract, element by element: each rank's partial
  is recomputed in float32 and rounded to the dtype, the rounded partials plus residual_in are
  summed in float64, and the tolerance is derived from the contract (float32 accumulation in the
  kernel, one rounding of each partial, one of the sum: the reference's `residual_expectation`);
* norm_out of rank 0 against the float64 RMSNorm of its own residual_out (`norm_expectation`);
* NVFP4: quant_out and the swizzled scale bytes of rank 0 exactly equal to the rule of docs/operation.md applied to
  its own norm_out (`nvfp4_blocks`), scale padding zero, the bytes past the required scale
  length untouched;
* every output of every rank bit-identical to rank 0's (which also proves every element written).

The counts are copied to pinned host memory and read one call later (two buffer slots
alternate), so the CPU never waits for the GPU of the call it just launched. Every
`--full-check-every` calls, and on any call whose cheap check fails, the float64 reference's
check_outputs (moe_ar_tools/reference/checks.py, per-element brackets) checks the call in full.
`world.check()` runs every `--check-every` calls and at the end: a peer-wait timeout is counted and
the world reset.
A call that does not finish within max(60 s, 5 deadlines) is a hang: recorded, and the process
exits with status 3 after writing the JSON.

Exit status: 0 when no element was wrong, no full check failed, no timeout and no hang; 1
otherwise; 2 for bad arguments.

The modules, by concern: sampling (token counts, regimes, each call's options), buffers (the
preallocated buffer sets), state, calls and runner (the Soak: its world and upkeep, one call and
its checks, the loop), result (the JSON and its summary line), cli (the command).
"""
