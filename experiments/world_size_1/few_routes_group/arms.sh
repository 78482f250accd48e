#!/usr/bin/env bash
# Build the probe's other trees under DEST (default .baselines) from this checkout: `fg_old`, the
# commit BASE as committed (FP8 group-128 without a few-routes build; the probe ran with 26960da),
# `fg_lat`, this working tree with the latency program's shape builds serving to 1,024 tokens
# (shape_constants.MAX_TOKENS 256 -> 1024; the probe's working tree had 256), and `fg_bs`, this
# working tree with sum_barriers.patch (the sums of squares without their last barrier and without
# the butterfly steps that add only zeros) and its programs generated; with LEAN=1 also `fg_lean`, this
# working tree with lean_stream_sum.patch (that change for the streaming program only; measured level, not taken).
# Run from the repository root
# with the venv's python first on PATH; carry DEST.
#   [DEST=.baselines] [BASE=26960da] [LEAN=1] bash experiments/world_size_1/few_routes_group/arms.sh
set -euo pipefail
dest=${DEST:-.baselines}; here=experiments/world_size_1/few_routes_group
rm -rf "$dest"/fg_old "$dest"/fg_lat "$dest"/fg_bs && mkdir -p "$dest"/fg_old "$dest"/fg_lat "$dest"/fg_bs
git archive "${BASE:-26960da}" | tar -xf - -C "$dest/fg_old"
for arm in fg_lat fg_bs; do git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$dest/$arm"; done
sed -i 's/^MAX_TOKENS = [0-9]* /MAX_TOKENS = 1024 /' "$dest/fg_lat/dispatch/shape_constants.py"
grep -q '^MAX_TOKENS = 1024 ' "$dest/fg_lat/dispatch/shape_constants.py"
sed -i 's/^MAX_TOKENS = [0-9]* /MAX_TOKENS = 256 /' "$dest/fg_bs/dispatch/shape_constants.py"
(cd "$dest/fg_bs" && git apply "$OLDPWD/$here/sum_barriers.patch" && PYTHONPATH=. python -m generator.cli)
if [ "${LEAN:-0}" = 1 ]; then
    rm -rf "$dest/fg_lean" && mkdir -p "$dest/fg_lean"
    git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$dest/fg_lean"
    (cd "$dest/fg_lean" && git apply "$OLDPWD/$here/lean_stream_sum.patch" && PYTHONPATH=. python -m generator.cli)
fi
rm -rf "$dest"/fg_*/bench_results "$dest"/fg_*/experiments  # not read by the bench: keep the trees small to carry
du -sh "$dest"/fg_*
