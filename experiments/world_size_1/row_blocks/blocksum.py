"""The fourth row_blocks run: the one-token-a-block kernel with its sum of squares by block_sum's
tree (variant bit 16: each thread's fma chain, a warp butterfly, one shared-memory round) instead
of the 128-element groups, against the groups and against no sum of squares. Same command as
variants.py, with blocksum.py."""
import importlib.util
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("row_blocks_overlap", HERE / "overlap.py")
o = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(o)

o.SYSTEMS = [(1, (prof, vec, 512, 1, var)) for prof in ("plain", "fp8_group128") for vec in (2, 1)
             for var in (0, 8, 16)] + [(8, ("plain", 1, 512, 1, 0)), (8, ("fp8_group128", 1, 512, 1, 0))]
o.SYSTEMS = [(C, k) for C, k in o.SYSTEMS if not (k[1] == 1 and C == 1)]  # one vector a thread: clusters only
o.SYSTEMS += [(1, ("plain", 4, 256, 1, 16))]
o.v.KERNELS = sorted({k for _, k in o.SYSTEMS})

if __name__ == "__main__":
    o.main()
