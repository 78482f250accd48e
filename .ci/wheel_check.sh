#!/usr/bin/env bash
# The wheel works outside the repository, with CUDA 13 and with CUDA 12 (no GPU needed):
#   1. build the wheel from the repository's files (tracked, and new ones git does not ignore);
#   2. a fresh venv outside the source tree: torch (the CPU build on local disk), then the wheel
#      with its cu13 extra; from a folder outside the tree: import dispatch and moe_ar_common (which
#      it shares with the generator), programs(), program_info(), the manifest verified, one program
#      NVRTC-compiled for sm_90a and sm_100a through the runtime (.ci/wheel_check.py), and
#      gen-programs list / tables / --check / --out;
#   3. another venv: the wheel alone (gen-programs compile names the extra to install), then with
#      its cu12 extra: every program compiled by NVRTC 12 for sm_90a and sm_100a (spills listed, not gated).
# One line per step with its seconds; the last line is "wheel: N passed, M failed"; exit 1 on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$(pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moe-ar-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
AWAY="$WORK/away"  # the folder every installed command runs in, outside the source tree
mkdir -p "$AWAY"
passed=0
failed=0
total_start=$SECONDS

summary() {
    echo "wheel check: $( [ "$failed" -eq 0 ] && echo PASS || echo FAIL ) in $((SECONDS - total_start)) s"
    echo "wheel: $passed passed, $failed failed"
}

# step NAME COMMAND...: run it (output to a log), print ok/FAIL with its seconds, the log's tail on failure.
step() {
    local name=$1 start=$SECONDS
    shift
    if "$@" > "$WORK/step.log" 2>&1; then
        passed=$((passed + 1))
        echo "ok    $name ($((SECONDS - start)) s)"
    else
        failed=$((failed + 1))
        echo "FAIL  $name ($((SECONDS - start)) s)"
        tail -n 40 "$WORK/step.log" | sed 's/^/      /'
    fi
}

# need NAME COMMAND...: a step the later ones depend on; stop at its failure.
need() {
    step "$@"
    if [ "$failed" -ne 0 ]; then
        summary
        exit 1
    fi
}

# In $AWAY, with nothing of the source tree on the path.
away() { (cd "$AWAY" && env -u PYTHONPATH "$@"); }

# fails_with PATTERN COMMAND...: the command exits 1, prints PATTERN and no traceback.
fails_with() {
    local pattern=$1 rc=0
    shift
    away "$@" > "$WORK/out.log" 2>&1 || rc=$?
    cat "$WORK/out.log"
    [ "$rc" -eq 1 ] && grep -qF -- "$pattern" "$WORK/out.log" && ! grep -q Traceback "$WORK/out.log"
}

build_wheel() {
    mkdir -p "$WORK/src" "$WORK/dist"
    git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
        [ -e "$f" ] && printf '%s\0' "$f"
    done | xargs -0 cp --parents -t "$WORK/src"
    pip wheel --no-deps -w "$WORK/dist" "$WORK/src"
    ls "$WORK"/dist/*.whl
}

make_venv() {  # make_venv DIR: a fresh venv with torch first (from local disk; see .ci/run)
    "$PY" -m venv "$1" && "$1/bin/pip" install --quiet torch==2.13.0
}

same_tree() {  # gen-programs --out renders the installed tree again, byte for byte
    away "$V13/bin/gen-programs" --out "$AWAY/rendered" &&
        diff -r -x __pycache__ "$AWAY/rendered" "$("$V13/bin/python" -c \
            'import dispatch.registry as r; print(r.GENERATED_DIR)')"
}

compile_all_12() {
    # Every program must build; the spill budgets are NVRTC 13's (the gate of the CPU tests), so NVRTC
    # 12's spills are listed, not failed (docs/ci.md: which programs spill there).
    away "$V12/bin/gen-programs" compile --arch sm_90a --arch sm_100a --jobs 2 --spills-as-warnings \
        > "$WORK/compile12.log" 2>&1
    local rc=$?
    tail -n 1 "$WORK/compile12.log"
    grep "spills" "$WORK/compile12.log" | grep -v "0 bytes spill stores, 0 bytes spill loads" | grep ": spills" \
        | sed 's/^/      NVRTC 12: /' | head -20
    [ "$rc" -eq 0 ] || { tail -n 60 "$WORK/compile12.log"; return 1; }
    grep -q "compiled clean" "$WORK/compile12.log"
}

need "build the wheel" build_wheel
WHEEL=$(ls "$WORK"/dist/*.whl)
echo "      $(basename "$WHEEL"): $(du -k "$WHEEL" | cut -f1) KiB"

# ---- CUDA 13 ---------------------------------------------------------------------------------
V13="$WORK/venv-cu13"
need "venv (cu13): torch, then the wheel with its cu13 extra" \
    bash -c "$(declare -f make_venv); PY='$PY' make_venv '$V13' && '$V13/bin/pip' install --quiet '$WHEEL[cu13]'"
step "cu13: dispatch from the installed files, manifest, NVRTC 13 compile for sm_90a and sm_100a" \
    away "$V13/bin/python" "$SRC/.ci/wheel_check.py" "$SRC" 13
step "cu13: gen-programs list" away "$V13/bin/gen-programs" list --family oneshot
step "cu13: gen-programs tables" away "$V13/bin/gen-programs" tables
step "cu13: gen-programs --check (the installed tree is what its generator renders)" away "$V13/bin/gen-programs" --check
step "cu13: gen-programs --out DIR renders the installed tree byte for byte" same_tree
step "cu13: plain gen-programs asks for a repository or --out" \
    fails_with "needs a repository or --out DIR" "$V13/bin/gen-programs"
step "cu13: gen-programs compile, one program, sm_90a and sm_100a" \
    away "$V13/bin/gen-programs" compile --family oneshot --dtype bf16 --world-size 2 --profile plain -j 2

# ---- CUDA 12 ---------------------------------------------------------------------------------
V12="$WORK/venv-cu12"
need "venv (cu12): torch, then the wheel without an extra" \
    bash -c "$(declare -f make_venv); PY='$PY' make_venv '$V12' && '$V12/bin/pip' install --quiet '$WHEEL'"
step "no extra: gen-programs compile names the extra to install" \
    fails_with "pip install '.[cu" "$V12/bin/gen-programs" compile --family oneshot --dtype bf16 --world-size 2 --profile plain
need "venv (cu12): the cu12 extra" "$V12/bin/pip" install --quiet "$WHEEL[cu12]"
step "cu12: dispatch from the installed files, manifest, NVRTC 12 compile for sm_90a and sm_100a" \
    away "$V12/bin/python" "$SRC/.ci/wheel_check.py" "$SRC" 12
step "cu12: NVRTC 12 compiles every program for sm_90a and sm_100a" compile_all_12

summary
[ "$failed" -eq 0 ]
