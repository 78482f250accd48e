#!/usr/bin/env bash
# Build the A/B's two trees under DEST (default .baselines) from this checkout: `off` with FP8
# group-128's streaming program never built per call shape, `on` with it built at every hidden size
# (shape_constants.STREAMING_MAX_HIDDEN["fp8_group128"] 0 and 16384). Run from the repository root,
# carry DEST to the GPU machine; prints the TREES line for stream_indices/ab.sh.
#   [DEST=.baselines] bash experiments/world_size_1/group_builds/arms.sh
set -euo pipefail
dest=${DEST:-.baselines}; trees=""
for arm in "off 0" "on 1 << 14"; do
    name=${arm%% *}; most=${arm#* }
    tree=$dest/group_$name
    rm -rf "$tree" && mkdir -p "$tree"
    git ls-files -co --exclude-standard | grep -v '^experiments/' | tar -cf - -T - | tar -xf - -C "$tree"
    sed -i "s/\"fp8_group128\": [0-9<> ]*}/\"fp8_group128\": $most}/" "$tree/dispatch/shape_constants.py"
    grep -q "\"fp8_group128\": $most}" "$tree/dispatch/shape_constants.py"
    rm -rf "$tree/bench_results"  # not read by the bench: keep the tree small to carry
    trees="$trees $name=$tree"
done
echo "TREES=\"${trees# }\""
