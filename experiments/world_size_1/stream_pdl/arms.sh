#!/usr/bin/env bash
# Build the A/B's trees under DEST (default .baselines): v0 = this checkout's programs; v1, v2 =
# variants.patch applied with MOE_AR_PROBE_PDL_TRIGGER 1 (the streaming layout lets the next kernel
# launch before its last token's epilogue), 2 (only when its blocks exit), each regenerated
# (gen-programs) in its own copy. Run from the repository root on this machine, then carry DEST to the
# GPU machine; prints the TREES line for ../stream_indices/ab.sh.
#   [PYTHON=.venv/bin/python] [DEST=.baselines] bash experiments/world_size_1/stream_pdl/arms.sh
set -euo pipefail
python=$(command -v "${PYTHON:-python3}")  # an absolute path: gen-programs runs inside each tree
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
dest=${DEST:-.baselines}; patch=$(pwd)/experiments/world_size_1/stream_pdl/variants.patch
trees=""
for arm in "v0 0" "v1 1" "v2 2"; do
    set -- $arm
    tree=$dest/pdl_$1
    rm -rf "$tree" && mkdir -p "$tree"
    git ls-files -co --exclude-standard | grep -v '^experiments/' | tar -cf - -T - | tar -xf - -C "$tree"
    if [ "$1" != v0 ]; then
        (cd "$tree" && patch -s -p1 < "$patch" \
            && sed -i "s/^#define MOE_AR_PROBE_PDL_TRIGGER 0/#define MOE_AR_PROBE_PDL_TRIGGER $2/" kernels/local.cuh \
            && grep -q "^#define MOE_AR_PROBE_PDL_TRIGGER $2" kernels/local.cuh \
            && "$python" -m generator.cli > /dev/null)
    fi
    rm -rf "$tree/bench_results"  # the generator's input, not the bench's: keep the tree small to carry
    trees="$trees $1=$tree"  # relative to the repository root, where ab.sh runs
done
echo "TREES=\"${trees# }\""
