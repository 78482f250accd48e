#!/usr/bin/env bash
# The probe's tree under DEST (default .baselines/small_rows_limit): this checkout with limit.patch
# applied (Python only: MOE_AR_PROBE_SMALL_ROW_MAX_TOKENS in the environment sets the cluster layout's
# token limit at rows under 12 warps, so one tree serves every arm). Run from the repository root
# here, then carry DEST/small_rows_limit.
#   [DEST=.baselines] bash experiments/world_size_1/small_rows_limit/arms.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); tree=${DEST:-.baselines}/small_rows_limit
rm -rf "$tree" && mkdir -p "$tree"
git ls-files -co --exclude-standard | grep -v '^experiments/' | tar -cf - -T - | tar -xf - -C "$tree"
(cd "$tree" && patch -s -p1 < "$here/limit.patch")
rm -rf "$tree/bench_results"
echo "tree: $tree"
