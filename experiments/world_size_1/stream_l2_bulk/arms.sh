#!/usr/bin/env bash
# The A/B's four trees under DEST (default .baselines/l2bulk_v0..3): v0 this checkout's programs; v1,
# v2, v3 variants.patch with MOE_AR_PROBE_L2_BULK 1 (this token's later routes to L2), 2 (the next
# token's rows to L2 before this token's epilogue), 3 (both). Prints the TREES line for run.sh's A/B.
#   [PYTHON=.venv/bin/python] [DEST=.baselines] bash experiments/world_size_1/stream_l2_bulk/arms.sh
here=$(dirname "$0")
exec bash "$here/../stream_indices/patch_trees.sh" "$here/variants.patch" MOE_AR_PROBE_L2_BULK l2bulk \
    v0=- v1=1 v2=2 v3=3
