#!/usr/bin/env bash
# The A/B's three trees under DEST (default .baselines/pdl_v0..2): v0 this checkout's programs; v1, v2
# variants.patch with MOE_AR_PROBE_PDL_TRIGGER 1 (the streaming layout lets the next kernel launch
# before its last token's epilogue), 2 (only when its blocks exit). Prints the TREES line for run.sh.
#   [PYTHON=.venv/bin/python] [DEST=.baselines] bash experiments/world_size_1/stream_pdl/arms.sh
here=$(dirname "$0")
exec bash "$here/../stream_indices/patch_trees.sh" "$here/variants.patch" MOE_AR_PROBE_PDL_TRIGGER pdl v0=- v1=1 v2=2
