"""The streaming row written in the Triton kernel's order: every route unrolled, each route's index,
weight and loads then its additions, the shared and residual rows' loads after the routes in the
source (ptxas hoists them to the front: a row's 24 loads before its first addition, then a rolling
window, as the Triton kernel's SASS), ptxas left to schedule under the program's register bound. The
same additions in the same order as local_row_batched (the same bits). NATURAL[0]: 0 the committed
source, 1 this row, 2 the same with the shared and residual rows loaded first in the source. Put into
the source of the streaming builds (the launcher's shape constants) in this process only.
Offline: `python natural.py [profiles]` prints registers, spills and the loads before the first
addition of each arm (sm_90a, H 7168 top_k 8)."""
from dispatch import registry

CALL = "local_row_batched<D, kMaxVecPerThread, kRoutes>(p, t, bad_rows, res);"
ANCHOR = "// Blocks stride over token rows"
ROW = r'''
template <typename D, int kVec, bool kResidualFirst>
__device__ __forceinline__ void local_row_natural(const Params& p, int t, unsigned& bad_rows,
                                                  uint4 (&res)[kMaxVecPerThread]) {
  const int H = row_hidden(p), K = row_top_k(p), nvec = H / kElemsPerVec, vpt = row_vec_per_thread(p);
  const D* residual = static_cast<const D*>(p.residual_in) + (long long)t * H;
  const D* shared = static_cast<const D*>(p.shared_in) + (long long)t * H;
  const int* idx = p.expanded_idx + (long long)t * K;
  uint4 resid[kVec], shared_row[kVec];
  float acc[kVec][8];
#pragma unroll
  for (int r = 0; r < kVec; ++r) {
    if (kResidualFirst) {
      const int v = r * row_threads() + threadIdx.x;
      const bool valid = r < vpt && v < nvec;
      resid[r] = valid ? *reinterpret_cast<const uint4*>(residual + v * kElemsPerVec) : make_uint4(0, 0, 0, 0);
      shared_row[r] = valid && p.shared_in != nullptr ? *reinterpret_cast<const uint4*>(shared + v * kElemsPerVec)
                                                      : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (k >= K) break;
    const int given = idx[k];
    const bool in_range = given >= 0 && given < p.rows;
    float s = 0.f;
    if (in_range) {
      if (row_scale_kind(p) == 0) s = 1.f;
      else if (row_scale_kind(p) == 1) s = static_cast<const float*>(p.expert_scale)[(long long)t * K + k];
      else s = Vec<D>::scalar(p.expert_scale, (long long)t * K + k);
    }
    const char* route = reinterpret_cast<const char*>(static_cast<const D*>(p.allreduce_in) +
                                                      (long long)max(given, 0) * H) + threadIdx.x * 16u;
#pragma unroll
    for (int r = 0; r < kVec; ++r) {
      const int v = r * row_threads() + threadIdx.x;
      const bool valid = r < vpt && v < nvec;
      const uint4 x4 = valid && in_range ? *reinterpret_cast<const uint4*>(route + r * (row_threads() * 16u))
                                         : make_uint4(0, 0, 0, 0);
      if (valid && given >= p.rows) ++bad_rows;
      float x[8];
      Vec<D>::to_float(x4, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(s, x[i], acc[r][i]);
    }
  }
  if (!kResidualFirst) {  // every vector's loads issued together (predicated), as the Triton kernel's
#pragma unroll
    for (int r = 0; r < kVec; ++r) {
      const int v = r * row_threads() + threadIdx.x;
      const bool valid = r < vpt && v < nvec;
      resid[r] = valid ? *reinterpret_cast<const uint4*>(residual + v * kElemsPerVec) : make_uint4(0, 0, 0, 0);
      shared_row[r] = valid && p.shared_in != nullptr ? *reinterpret_cast<const uint4*>(shared + v * kElemsPerVec)
                                                      : make_uint4(0, 0, 0, 0);
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

'''
NATURAL = [0]
_source_for = registry._manifest.source_for
_cached_cubin = registry.cached_cubin


def source_for(manifest, d, name):
    s = _source_for(manifest, d, name)
    if NATURAL[0] and "_local_streaming_" in name:
        assert s.count(CALL) == 1 and s.count(ANCHOR) == 1, name
        first = "true" if NATURAL[0] == 2 else "false"
        s = s.replace(ANCHOR, ROW + ANCHOR).replace(
            CALL, "\n#ifdef MOE_AR_FIXED_TOP_K\n"
            f"local_row_natural<D, kMaxVecPerThread, {first}>(p, t, bad_rows, res);\n#else\n{CALL}\n#endif\n")
    return s


registry._manifest.source_for = source_for


if __name__ == "__main__":
    import re
    import sys
    from dispatch import shape_constants
    from moe_ar_tools import sass_diff
    tools = sass_diff.find_tools()
    ps = registry.program_set()
    for profile in sys.argv[1:] or ("plain",):
        name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
        for arm in (0, 1, 2):
            NATURAL[0] = arm
            src = shape_constants.defines(7168, 8, 1, 4, 224) + source_for(ps.manifest, ps.dir, name)
            cubin, log = registry.compile_cubin(src, name, "sm_90a")
            sass = sass_diff.disassemble(sass_diff.complete_cubin(cubin), tools)
            body = sass.split("Function : " + name, 1)[1]
            ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\w+\s+)?([A-Z0-9.]+)", body)
            first_ffma = next(i for i, o in enumerate(ops) if o.startswith("FFMA"))
            ldg_before = sum(1 for o in ops[:first_ffma] if o.startswith("LDG.E.128"))
            registers = re.search(r"Used (\d+) registers", str(log)).group(1)
            spill = max(int(b) for b in re.findall(r"(\d+) bytes spill", str(log)))
            print(f"{profile} arm {arm}: {registers} registers, {spill} bytes spilled, {len(ops)} SASS instructions, "
                  f"{sum(o.startswith('LDG.E.128') for o in ops)} 16-byte loads, {ldg_before} before the first FFMA")
