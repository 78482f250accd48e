"""Second pass of clone.py, its kernel and harness with other arms, all with the shared and residual rows
first: 256 threads on a grid of T; the Triton kernel's plain ld.global instead of ld.global.nc; every
index and weight of the token read first; both; and p224_all3 (our streaming program's three features)
beside ours again at 192-512 tokens, where clone.py's one run found it 0.94x of our time warm at 256
tokens (bench_results/world_size_1/plain_clone/).

    python experiments/world_size_1/plain_clone/clone2.py OUT_JSON
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import clone  # noqa: E402

# clone.py's kernel template (the same clone_row), with these entries in place of its own
ENTRIES = r'''
#define ENTRY(NAME, NT, A, B, C, D, E) extern "C" __global__ void __launch_bounds__(NT, 2) clone_##NAME( \
    const __nv_bfloat16* x, const int* idx, const float* w, const __nv_bfloat16* shared, \
    const __nv_bfloat16* res_in, const __nv_bfloat16* gamma, __nv_bfloat16* res_out, __nv_bfloat16* norm_out, \
    int T, int rows, float rsf, float eps) { \
  clone_row<NT, A, B, C, D, E>(x, idx, w, shared, res_in, gamma, res_out, norm_out, T, rows, rsf, eps); }
ENTRY(res_first, 224, true, false, false, false, false)
ENTRY(all3, 224, true, true, true, false, false)
ENTRY(rf256, 256, true, false, false, false, false)
ENTRY(rf_plain, 224, true, false, false, true, false)
ENTRY(rf_idx_first, 224, true, false, false, false, true)
ENTRY(rf_plain_idx_first, 224, true, false, false, true, true)
ENTRY(rf256_plain_idx_first, 256, true, false, false, true, true)
'''
SOURCE = clone.SOURCE[:clone.SOURCE.index("#define ENTRY")] + ENTRIES

# arm: (entry, threads, persistent grid)
ARMS = {"p224_res_first": ("res_first", 224, True), "p224_all3": ("all3", 224, True),
        "g256_res_first": ("rf256", 256, False), "p256_res_first": ("rf256", 256, True), "p224_rf_plain": ("rf_plain", 224, True),
        "p224_rf_idx_first": ("rf_idx_first", 224, True), "p224_rf_plain_idx_first": ("rf_plain_idx_first", 224, True),
        "g256_rf_plain_idx_first": ("rf256_plain_idx_first", 256, False)}

if __name__ == "__main__":
    clone.main(sys.argv[1], source=SOURCE, arms=ARMS, tokens=(192, 256, 512, 1024, 2048, 8192))
