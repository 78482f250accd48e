"""Patch a copy of the tree (python patch_tree.py TREE EXTRA, then regenerate it with gen-programs): the
world-size-1 ring keeps LOCAL_STREAMING_ROW_STAGES - EXTRA rows in flight, and up to EXTRA more from a
token's last row until its epilogue is done (RowRing::epilogue_issue). EXTRA 0 leaves the tree as it is."""
import re, sys
root, extra = sys.argv[1], int(sys.argv[2])
p = f"{root}/kernels/row_ring.cuh"
s = open(p).read()
s = s.replace("struct RowRing {\n", "struct RowRing {\n  static constexpr int kExtra = kLocal ? %d : 0, kAhead = kStages - kExtra;\n" % extra, 1)
s = s.replace("      for (int s = 0; s < kStages; ++s) issue_next(p);", "      for (int s = 0; s < kAhead; ++s) issue_next(p);", 1)
s = s.replace("""    ++used;
    if (threadIdx.x == 0) issue_next(p);
  }""", """    ++used;
    if (threadIdx.x == 0 && (kExtra == 0 || (int)(issued - used) < kAhead)) issue_next(p);
  }
  // After a token's last row: up to kExtra more rows in flight while the block runs the epilogue.
  __device__ __forceinline__ void epilogue_issue(const Params& p) {
    if (kExtra > 0 && threadIdx.x == 0)
      for (int e = 0; e < kExtra; ++e)
        if ((int)(issued - used) < kStages) issue_next(p);
  }""", 1)
assert s.count("kAhead") >= 3, "patch"
open(p, "w").write(s)
q = f"{root}/kernels/local.cuh"
s = open(q).read()
s = s.replace("""    residual_out[v] = res[r];
  }
  ring.release_row(p);
}""", """    residual_out[v] = res[r];
  }
  ring.release_row(p);
  ring.epilogue_issue(p);
}""", 1)
assert "epilogue_issue" in s
open(q, "w").write(s)
