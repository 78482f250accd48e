"""Bytes one rank's workspace allocates, per world size and max_tokens (docs/workspace-memory.md).

    PYTHONPATH=. python docs/workspace_memory.py      # from the repository root; prints the doc's tables
    PYTHONPATH=. python docs/workspace_memory.py --boundary 16=16   # assume a boundary where no table is

Per rank (dispatch/workspace.py, _RankMemory): 3 rotating buffers of buffer_elems_for(...) elements,
STATE_WORDS uint32 of device state and ERROR_WORDS uint32 of host-mapped error words. The buffer
is the larger of the one-shot layout (W * oneshot_max_tokens * H) and the two-shot layout
(W * ceil(T / W) * H + T * H, about 2 * T * H). Sizes as requested; the driver's own rounding
(allocation granularity) is not counted.
"""
from __future__ import annotations

import argparse
import json
import pathlib

from dispatch.workspace import ERROR_WORDS, STATE_WORDS, buffer_elems_for

HIDDEN = 7168
ELEM_BYTES = 2  # bf16
WORLD_SIZES = (2, 4, 8, 16)
MAX_TOKENS = (1, 128, 1024, 8192, 16384, 65536)
DEFAULT_ONESHOT_CAP = 1024  # Workspace's default: oneshot_max_tokens = min(max_tokens, 1024)
MANIFEST = pathlib.Path(__file__).resolve().parent.parent / "generated" / "manifest.json"


def rank_bytes(W: int, T: int, oneshot_tokens: int) -> tuple[int, int, str]:
    """(device bytes, host-mapped bytes, the layout that sizes the buffer) of one rank."""
    elems = buffer_elems_for(W, T, HIDDEN, oneshot_tokens)
    oneshot = W * oneshot_tokens * HIDDEN
    twoshot = W * -(-T // W) * HIDDEN + T * HIDDEN
    which = "both" if oneshot == twoshot else "1-shot" if oneshot > twoshot else "2-shot"
    return 3 * elems * ELEM_BYTES + STATE_WORDS * 4, ERROR_WORDS * 4, which


def human(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def largest_oneshot_boundary() -> dict:
    """World size -> the largest oneshot_max_tokens of the committed selection tables (over dtypes and
    output profiles): beyond it no table selects the one-shot, so buffers past it serve no automatic call."""
    out = {}
    for b in json.loads(MANIFEST.read_text())["selection"]["boundaries"]:
        out[b["world_size"]] = max(out.get(b["world_size"], 0), b["oneshot_max_tokens"])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--boundary", action="append", default=[], metavar="W=B",
                    help="a one-shot boundary B for world size W where the manifest has none (repeatable)")
    args = ap.parse_args(argv)
    assumed = {int(w): int(b) for w, b in (x.split("=") for x in args.boundary)}
    print(f"H {HIDDEN}, {ELEM_BYTES}-byte elements (bf16); device bytes of one rank: 3 buffers + "
          f"{STATE_WORDS * 4} B of state; plus {ERROR_WORDS * 4} B of host-mapped error words (pinned host memory)\n")

    print("Default one-shot capacity, oneshot_max_tokens = min(max_tokens, 1024); [which layout sizes the buffer]\n")
    print("| max_tokens | " + " | ".join(f"W = {W}" for W in WORLD_SIZES) + " |")
    print("|---:|" + "---:|" * len(WORLD_SIZES))
    for T in MAX_TOKENS:
        cells = []
        for W in WORLD_SIZES:
            dev, _, which = rank_bytes(W, T, min(T, DEFAULT_ONESHOT_CAP))
            cells.append(f"{human(dev)} [{which}]")
        print(f"| {T} | " + " | ".join(cells) + " |")
    print()

    print("Emulated world on one GPU (EmulatedWorld: all W ranks' workspaces on one device), default capacity\n")
    print("| max_tokens | " + " | ".join(f"W = {W}" for W in WORLD_SIZES) + " |")
    print("|---:|" + "---:|" * len(WORLD_SIZES))
    for T in MAX_TOKENS:
        print(f"| {T} | " + " | ".join(human(W * rank_bytes(W, T, min(T, DEFAULT_ONESHOT_CAP))[0])
                                        for W in WORLD_SIZES) + " |")
    print()

    bounds = largest_oneshot_boundary() if MANIFEST.exists() else {}
    assumed = {W: B for W, B in assumed.items() if W not in bounds}
    bounds.update(assumed)
    sized = [W for W in WORLD_SIZES if W in bounds]
    missing = [W for W in WORLD_SIZES if W not in bounds]
    print("One-shot capacity sized to the selection tables: oneshot_max_tokens = min(max_tokens, B), B = the "
          "largest one-shot boundary of the committed tables for W (" +
          ", ".join(f"W {W}: B = {bounds[W]}" + (" assumed" if W in assumed else "") for W in sized) +
          "); the saving against the default capacity\n")
    if missing:
        print(f"(world size{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: no tables in "
              f"{MANIFEST.name}, left out)\n")
    print("| max_tokens | " + " | ".join(f"W = {W}" for W in sized) + " |")
    print("|---:|" + "---:|" * len(sized))
    for T in MAX_TOKENS:
        cells = []
        for W in sized:
            default, _, _ = rank_bytes(W, T, min(T, DEFAULT_ONESHOT_CAP))
            dev, _, which = rank_bytes(W, T, min(T, bounds[W]))
            saved = default - dev
            cells.append(f"{human(dev)} [{which}]" + (f", {human(saved)} less ({100 * saved / default:.0f}%)"
                                                      if saved else ", same"))
        print(f"| {T} | " + " | ".join(cells) + " |")
    print()


if __name__ == "__main__":
    main()
