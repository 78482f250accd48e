#!/usr/bin/env bash
# The A/B's two trees under DEST (default .baselines/nx_v0, nx_v1): v0 this checkout's programs; v1
# variants.patch with MOE_AR_PROBE_NEXT_IDX 1 (the streaming layout reads the block's next token's
# first indices and weights under this token's first rows). Prints the TREES line for run.sh.
#   [PYTHON=.venv/bin/python] [DEST=.baselines] bash experiments/world_size_1/stream_next_idx/arms.sh
here=$(dirname "$0")
exec bash "$here/../stream_indices/patch_trees.sh" "$here/variants.patch" MOE_AR_PROBE_NEXT_IDX nx v0=- v1=1
