#!/usr/bin/env bash
# The probe's tree under DEST (default .baselines/small_rows_streaming): this checkout with
# streaming.patch applied (Python only: MOE_AR_PROBE_STREAM_CAP, MOE_AR_PROBE_STREAM_VEC and
# MOE_AR_PROBE_STREAM_ANY_TOP_K in the environment pick the arm, so one tree serves every arm). Run
# from the repository root here, then carry DEST/small_rows_streaming.
#   [DEST=.baselines] bash experiments/world_size_1/small_rows_streaming/arms.sh
here=$(cd "$(dirname "$0")" && pwd)
PATCH=$here/streaming.patch NAME=small_rows_streaming exec bash "$here/../small_rows_one_vector/arms.sh"
