"""Reference for MoE finalize + all-reduce + residual add + RMSNorm (+ NVFP4).

Pure torch; every function works on CPU tensors (and on CUDA tensors, for cheap
checks inside GPU tests). Follows docs/operation.md:

* Precision contract: each rank's partial is computed in float64 and rounded
  ONCE to the dtype D (it travels as D); the cross-rank sum plus residual_in is
  float64, rounded once to D -> residual_out; norm_out is D of the float64
  RMSNorm of residual_out (as float64).
* Rounding float64 -> D is done correctly (single rounding). torch converts
  float64 -> bf16/fp16 through float32, which is a double rounding; we round to
  odd at float32 first (24 >= p + 2 bits), which makes the second rounding exact.
* NVFP4 follows docs/operation.md step by step in float32 arithmetic: every multiply and
  division is a float32 tensor op (tensor / tensor, never tensor / python scalar,
  which CUDA torch turns into a multiply by a rounded reciprocal).

Besides the reference values, this package derives the set of results a correct
kernel may legally produce (the kernel accumulates in float32, not float64):
`reference()` returns per-element bounds [residual_lo, residual_hi] and
`norm_bracket()` gives the same for norm_out given the kernel's own residual_out.
The derivation is in the docstrings; `check_outputs()` applies them.

The modules, by concern: rounding (dtypes, unit roundoffs, single rounding), contract (the op in
float64 and the brackets), quant (the NVFP4 and FP8 encoders), cases (random inputs), checks
(poisoned outputs, check_outputs), cheap_check (the per-element tolerances of the soak's check on
the device). Every public name is importable from the package (`from moe_ar_tools import
reference as ref`; `ref.check_outputs`).
"""
# The runtime's output sizes, which tests read from here too (ref.scale_out_bytes).
from dispatch.op import FP8_GROUP, fp8_scale_shape, scale_out_bytes
from moe_ar_tools.reference.cases import Case, make_case, reference_for, typical_global_scale
from moe_ar_tools.reference.cheap_check import count_bad, norm_expectation, residual_expectation
from moe_ar_tools.reference.checks import (FP8_POISON_BYTE, POISON_BYTE, alloc_outputs, check_outputs, repoison,
                                           ulp)
from moe_ar_tools.reference.contract import (RESIDUAL_BRACKET_DOC, finalize_partial, norm_bracket, norm_rel_bound,
                                             reference, rmsnorm_f64)
from moe_ar_tools.reference.quant import (E2M1_BOUNDARIES, E2M1_VALUES, E4M3_MAX, E4M3_NAN_BYTE, FP8_EPS,
                                          e2m1_decode, e2m1_nibbles, e4m3_satfinite_bytes, fp8_group_ref,
                                          fp8_tensor_ref, nvfp4_block_scales, nvfp4_blocks, nvfp4_dequant,
                                          nvfp4_ref, pow2_ceil, swizzle_offsets, unswizzle)
from moe_ar_tools.reference.rounding import (DTYPE_TO_NAME, NAME_TO_DTYPE, SUBNORMAL_SPACING, U32, UNIT_ROUNDOFF,
                                             as_torch_dtype, dtype_name, f32, gamma, round_to_dtype)
