"""Probe: what a kernel that touches memory costs at its floor (graph replay of back-to-back calls)."""
import json, os, sys
import torch, cupy as cp
from moe_ar_common import cuda_env
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import timed, warm_up  # noqa: E402
SRC = r'''
#include <cuda_bf16.h>
extern "C" __global__ void k_empty(const int* a, int* o) {}
extern "C" __global__ void k_store(const int* a, int* o) { if (threadIdx.x == 0) o[0] = 1; }
extern "C" __global__ void k_load1(const int* a, int* o) { if (threadIdx.x == 0) o[0] = a[0]; }
extern "C" __global__ void k_load2(const int* a, int* o) { if (threadIdx.x == 0) o[0] = a[a[0]]; }
extern "C" __global__ void k_load3(const int* a, int* o) { if (threadIdx.x == 0) o[0] = a[a[a[0]]]; }
// one block: every thread loads 2 x 16 B of a 14 KB row and stores it (one round trip)
extern "C" __global__ void k_row(const int* a, int* o) {
  const uint4* s = reinterpret_cast<const uint4*>(a + 64); uint4* d = reinterpret_cast<uint4*>(o + 64);
  uint4 x = s[threadIdx.x], y = s[threadIdx.x + 448]; d[threadIdx.x] = x; d[threadIdx.x + 448] = y; }
// + a block-wide sum (one __syncthreads round) before the store
extern "C" __global__ void k_row_sum(const int* a, int* o) {
  __shared__ float part[32];
  const uint4* s = reinterpret_cast<const uint4*>(a + 64); uint4* d = reinterpret_cast<uint4*>(o + 64);
  uint4 x = s[threadIdx.x], y = s[threadIdx.x + 448];
  float v = __int_as_float(x.x) + __int_as_float(y.x);
  for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffff, v, m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f; for (int w = 0; w < 14; ++w) t += part[w];
  x.y = __float_as_int(t); d[threadIdx.x] = x; d[threadIdx.x + 448] = y; }
// indices, then 8 routed rows + 2 rows (2 dependent round trips), sum, store
extern "C" __global__ void k_gather(const int* a, int* o) {
  const int* idx = a; const uint4* rows = reinterpret_cast<const uint4*>(a + 64);
  uint4 r0 = rows[9 * 896 + threadIdx.x], r1 = rows[8 * 896 + threadIdx.x];
  int k[8]; for (int i = 0; i < 8; ++i) k[i] = idx[i] & 7;
  uint4 acc = r0; for (int i = 0; i < 8; ++i) { uint4 x = rows[k[i] * 896 + threadIdx.x]; acc.x += x.x; acc.y ^= x.y; acc.z += x.z; acc.w ^= x.w; }
  acc.x += r1.x; reinterpret_cast<uint4*>(o + 64)[threadIdx.x] = acc; }
'''
out = os.environ["OUT"]
mod = cp.RawModule(code=SRC, options=("-std=c++17", "--gpu-architecture=sm_90a", "-I" + cuda_env.include_dir()))
dev = torch.device("cuda")
warm_up()
res = {}
for label, n_sets in (("l2", 10), ("hbm", 400)):
    ins = [torch.zeros(64 + 10 * 896 * 4, dtype=torch.int32, device=dev) for _ in range(n_sets)]
    outs = [torch.zeros(64 + 896 * 8, dtype=torch.int32, device=dev) for _ in range(n_sets)]
    for x in ins: x[:8] = torch.arange(8, device=dev, dtype=torch.int32); x[0] = 1
    r = {}
    for name, threads in (("k_empty", 32), ("k_empty", 448), ("k_store", 32), ("k_load1", 32), ("k_load2", 32),
                          ("k_load3", 32), ("k_row", 448), ("k_row_sum", 448), ("k_gather", 896)):
        f = mod.get_function(name)
        def launch(i, f=f, threads=threads):
            f((1,), (threads,), (cp.uint64(ins[i].data_ptr()), cp.uint64(outs[i].data_ptr())))
        r[f"{name}_{threads}"] = round(timed(launch, n_sets, n_sets if label == "hbm" else 10), 3)
    res[label] = r
    print(label, json.dumps(r), flush=True)
# 2 x empty with PDL is what the target is measured against; also the GPU's clocks
json.dump(res, open(f"{out}/floor_pieces.json", "w"), indent=1)
