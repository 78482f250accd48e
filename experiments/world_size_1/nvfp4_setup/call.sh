#!/usr/bin/env bash
# One device call (about 330 s on one H200): setup.patch applied to the device's copy of the tree,
# the programs regenerated, then ab.py's interleaved arms at 1-128 tokens (NVFP4; plain in the c
# and c8 arms). Results under $OUT (4 files): gpu.txt, ab.log, table.md (table.py), run.tgz (each
# arm's bench folder and log). The copy's tracked files come fresh at the next call.
#   bash experiments/world_size_1/nvfp4_setup/call.sh        (kind nvidia-h200; AB_BUDGET: s an arm)
set -uo pipefail
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOE_AR_CACHE_DIR=${MOE_AR_CACHE_DIR:-/tmp/moe-ar-cache}
here=experiments/world_size_1/nvfp4_setup
O=${OUT:-gpu-out}; mkdir -p "$O/run"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$O/gpu.txt"
git rev-parse --short HEAD >> "$O/gpu.txt" 2>/dev/null
(git apply "$here/setup.patch" 2>/dev/null || patch -p1 < "$here/setup.patch") || { echo "setup.patch does not apply"; exit 2; }
PYTHONPATH=. python3 -m generator.cli > /dev/null || exit 2
PYTHONPATH=. timeout 480 python3 "$here/ab.py" "$O/run" "${AB_BUDGET:-18}" 2>&1 | tee "$O/ab.log"
python3 "$here/table.py" "$O/run" | tee "$O/table.md"
tar czf "$O/run.tgz" -C "$O" run && rm -rf "$O/run"
