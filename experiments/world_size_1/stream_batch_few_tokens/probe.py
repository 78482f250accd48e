"""The streaming program's builds loading 2 (committed) or 4 routes of a row at a time, where a block
holds one token (T up to the grid) and a little past it. The arm's define goes only into builds (the
committed program never sees it); the source's one streaming call takes it, textually, in this
process only. Used by ab.py (GPU) and offline with --offline (registers and spills, sm_90a)."""
from dispatch import registry

CALL = "local_row_batched<D, kMaxVecPerThread, kRoutes>(p, t, bad_rows, res);"
PROBE = "local_row_batched<D, kMaxVecPerThread, MOE_AR_PROBE_STREAM_BATCH>(p, t, bad_rows, res);"
DEFAULT = "#ifndef MOE_AR_PROBE_STREAM_BATCH\n#define MOE_AR_PROBE_STREAM_BATCH kRoutes\n#endif\n"
batch = [0]  # 0: the committed source and builds
_source_for = registry._manifest.source_for
_cached_cubin = registry.cached_cubin


def source_for(manifest, d, name):
    s = _source_for(manifest, d, name)
    if batch[0] and "_local_streaming_" in name:
        assert s.count(CALL) == 1, name
        s = DEFAULT + s.replace(CALL, PROBE)
    return s


def cached_cubin(name, target, prefix=""):
    if batch[0] and prefix:
        prefix += f"#define MOE_AR_PROBE_STREAM_BATCH {batch[0]}\n"
    return _cached_cubin(name, target, prefix)


registry._manifest.source_for = source_for
registry.cached_cubin = cached_cubin


if __name__ == "__main__":
    import re
    from dispatch import shape_constants
    ps = registry.program_set()
    for profile in ("plain", "fp8_tensor", "nvfp4"):
        name = f"moe_ar_local_streaming_bf16_ws1_{profile}"
        for b in (0, 4):
            batch[0] = b
            pre = shape_constants.defines(7168, 8, 1, 4, 224) + (f"#define MOE_AR_PROBE_STREAM_BATCH {b}\n" if b else "")
            cubin, log = registry.compile_cubin(pre + source_for(ps.manifest, ps.dir, name), name, "sm_90a")
            registers = re.search(r"Used (\d+) registers", str(log)).group(1)
            spill = max(int(n) for n in re.findall(r"(\d+) bytes spill", str(log)))
            print(f"{profile}, {b or 'committed'} routes a batch: {registers} registers, {spill} bytes spilled")
