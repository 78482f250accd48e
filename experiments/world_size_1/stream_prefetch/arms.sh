#!/usr/bin/env bash
# Build the A/B's trees under DEST (default .baselines): v0 = this checkout's programs; v1, v2, v3 =
# variants.patch applied with its probes set (v1 PREFETCH, v2 PREFETCH + ROUTE_COUNT, v3 ROUTE_COUNT),
# each regenerated (gen-programs) in its own copy; v4 = v2 with FP8 group-128's streaming program
# built per call shape too (shape_constants.STREAMING_PROFILES). Run from the repository root on this machine,
# then carry DEST to the GPU machine; prints the TREES line for stream_indices/ab.sh.
#   [PYTHON=.venv/bin/python] [DEST=.baselines] bash experiments/world_size_1/stream_prefetch/arms.sh
set -euo pipefail
python=$(command -v "${PYTHON:-python3}")  # an absolute path: gen-programs runs inside each tree
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
dest=${DEST:-.baselines}; patch=$(pwd)/experiments/world_size_1/stream_prefetch/variants.patch
trees=""
for arm in "v0 0 0" "v1 1 0" "v2 1 1" "v3 0 1" "v4 1 1"; do
    set -- $arm
    tree=$dest/prefetch_$1
    rm -rf "$tree" && mkdir -p "$tree"
    git ls-files -co --exclude-standard | grep -v '^experiments/' | tar -cf - -T - | tar -xf - -C "$tree"
    if [ "$1" != v0 ]; then
        (cd "$tree" && patch -s -p1 < "$patch" \
            && sed -i "s/^#define MOE_AR_PROBE_PREFETCH 0/#define MOE_AR_PROBE_PREFETCH $2/; s/^#define MOE_AR_PROBE_ROUTE_COUNT 0/#define MOE_AR_PROBE_ROUTE_COUNT $3/" kernels/local.cuh \
            && "$python" -m generator.cli > /dev/null)
    fi
    if [ "$1" = v4 ]; then
        sed -i 's/^STREAMING_PROFILES = ("plain", "nvfp4", "fp8_tensor")/STREAMING_PROFILES = ("plain", "nvfp4", "fp8_tensor", "fp8_group128")/' \
            "$tree/dispatch/shape_constants.py"
        grep -q '"fp8_group128")  #' "$tree/dispatch/shape_constants.py"
    fi
    # the bench results are the generator's input, not the bench's: keep the tree small to carry
    rm -rf "$tree/bench_results"
    trees="$trees $1=$tree"  # relative to the repository root, where ab.sh runs
done
echo "TREES=\"${trees# }\""
