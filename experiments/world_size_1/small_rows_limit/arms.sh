#!/usr/bin/env bash
# The probe's tree under DEST (default .baselines/small_rows_limit): this checkout with limit.patch
# applied (Python only: MOE_AR_PROBE_SMALL_ROW_MAX_TOKENS in the environment sets the cluster layout's
# token limit at rows under 12 warps, so one tree serves every arm). Run from the repository root
# here, then carry DEST/small_rows_limit.
#   [DEST=.baselines] bash experiments/world_size_1/small_rows_limit/arms.sh
here=$(cd "$(dirname "$0")" && pwd)
PATCH=$here/limit.patch NAME=small_rows_limit exec bash "$here/../small_rows_one_vector/arms.sh"
