#!/usr/bin/env bash
# Build an A/B's trees under DEST (default .baselines) from this checkout, one per arm NAME=VALUE:
# DEST/PREFIX_NAME with PATCH applied, `#define DEFINE 0` of kernels/local.cuh set to VALUE and the
# programs regenerated (gen-programs); VALUE "-" keeps this checkout's programs, unpatched. Run from
# the repository root on this machine, then carry DEST to the GPU machine; prints the TREES line for
# ab.sh.
#   [PYTHON=.venv/bin/python] [DEST=.baselines] bash experiments/world_size_1/stream_indices/patch_trees.sh \
#       PATCH DEFINE PREFIX NAME=VALUE [NAME=VALUE ...]
set -euo pipefail
patch=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); define=$2; prefix=$3; shift 3
python=$(command -v "${PYTHON:-python3}")  # an absolute path: gen-programs runs inside each tree
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
dest=${DEST:-.baselines}; trees=""
for arm in "$@"; do
    name=${arm%%=*}; value=${arm#*=}
    tree=$dest/${prefix}_$name
    rm -rf "$tree" && mkdir -p "$tree"
    git ls-files -co --exclude-standard | grep -v '^experiments/' | tar -cf - -T - | tar -xf - -C "$tree"
    if [ "$value" != - ]; then
        (cd "$tree" && patch -s -p1 < "$patch" \
            && sed -i "s/^#define $define 0\$/#define $define $value/" kernels/local.cuh \
            && grep -q "^#define $define $value\$" kernels/local.cuh \
            && "$python" -m generator.cli > /dev/null)
    fi
    rm -rf "$tree/bench_results"  # the generator's input, not the bench's: keep the tree small to carry
    trees="$trees $name=$tree"  # relative to the repository root, where ab.sh runs
done
echo "TREES=\"${trees# }\""
