#!/usr/bin/env bash
# The probe's tree under DEST (default .baselines/one_vector): this checkout with one_vector.patch
# applied (a Python change: MOE_AR_PROBE_ONE_VECTOR=1 in the environment turns it on, so one tree
# serves both arms). Run from the repository root on this machine, then carry DEST/one_vector.
# PATCH and NAME give another probe's patch and tree name (small_rows_limit/arms.sh).
#   [DEST=.baselines] bash experiments/world_size_1/small_rows_one_vector/arms.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); tree=${DEST:-.baselines}/${NAME:-one_vector}
patch_file=$(cd "$(dirname "${PATCH:-$here/one_vector.patch}")" && pwd)/$(basename "${PATCH:-one_vector.patch}")
rm -rf "$tree" && mkdir -p "$tree"
git ls-files -co --exclude-standard | grep -v '^experiments/' | tar -cf - -T - | tar -xf - -C "$tree"
(cd "$tree" && patch -s -p1 < "$patch_file")
rm -rf "$tree/bench_results"
echo "tree: $tree"
