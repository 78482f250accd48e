"""Bytes one rank's workspace allocates, per world size and max_tokens (docs/workspace-memory.md).

    PYTHONPATH=. python docs/workspace_memory.py      # from the repository root; prints the doc's tables

Per rank (dispatch/rank_memory.py, RankMemory): 3 rotating buffers of buffer_elems_for(...) elements,
STATE_WORDS uint32 of device state and ERROR_WORDS uint32 of host-mapped error words. The buffer
is the larger of the one-shot layout (W * oneshot_max_tokens * H) and the two-shot layout
(W * ceil(T / W) * H + T * H, about 2 * T * H). Sizes as requested; the driver's own rounding
(allocation granularity) is not counted.
"""
from __future__ import annotations

import argparse

from dispatch import gpu_facts, registry, table_sets
from dispatch.rank_memory import ERROR_WORDS, STATE_WORDS
from dispatch.workspace_sizes import buffer_elems_for

HIDDEN = 7168
ELEM_BYTES = 2  # bf16
WORLD_SIZES = (2, 4, 8, 16)
MAX_TOKENS = (1, 128, 1024, 8192, 16384, 65536)
FORCED_CAP = 1024  # the capacity the benchmark's sweeps ask for (and the default before the tables sized it)
DEVICE = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink")  # the device whose tables size the default


def oneshot_boundary(W: int) -> int:
    """The default one-shot capacity's bound B of a bf16 workspace of HIDDEN on DEVICE."""
    selection = table_sets.resolve(dtype="bf16", world_size=W, hidden=HIDDEN, elem_bytes=ELEM_BYTES, device=DEVICE,
                                   user=None, program_set_sha256="")
    return selection.oneshot_capacity(dict(registry.program_set().ladder)[registry.ONESHOT_REGIME])


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


def table(title: str, cell) -> None:
    """A markdown table of cell(W, T) per max_tokens (rows) and world size (columns), under `title`."""
    print(title + "\n")
    print("| max_tokens | " + " | ".join(f"W = {W}" for W in WORLD_SIZES) + " |")
    print("|---:|" + "---:|" * len(WORLD_SIZES))
    for T in MAX_TOKENS:
        print(f"| {T} | " + " | ".join(cell(W, T) for W in WORLD_SIZES) + " |")
    print()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    bounds = {W: oneshot_boundary(W) for W in WORLD_SIZES}
    print(f"H {HIDDEN}, {ELEM_BYTES}-byte elements (bf16); device bytes of one rank: 3 buffers + "
          f"{STATE_WORDS * 4} B of state; plus {ERROR_WORDS * 4} B of host-mapped error words (pinned host memory)\n")

    def default(W, T):
        dev, _, which = rank_bytes(W, T, min(T, bounds[W]))
        return f"{human(dev)} [{which}]"

    def forced(W, T):
        base = rank_bytes(W, T, min(T, bounds[W]))[0]
        dev, _, which = rank_bytes(W, T, min(T, FORCED_CAP))
        more = dev - base
        return f"{human(dev)} [{which}]" + (f", {human(more)} more (the default saves {100 * more / dev:.0f}%)"
                                            if more else ", same")

    table("Default one-shot capacity, oneshot_max_tokens = min(max_tokens, B), B = the largest one-shot boundary "
          f"of the tables an {DEVICE.product} with NVLink selects for W (" + ", ".join(f"W {W}: B = {bounds[W]}" for W in WORLD_SIZES) +
          "); [which layout sizes the buffer]", default)
    table("Emulated world on one GPU (EmulatedWorld: all W ranks' workspaces on one device), default capacity",
          lambda W, T: human(W * rank_bytes(W, T, min(T, bounds[W]))[0]))
    table(f"With oneshot_max_tokens = min(max_tokens, {FORCED_CAP}) (room for a one-shot forced with program= up "
          f"to {FORCED_CAP} tokens; the default before the tables sized it): how much more than the default", forced)


if __name__ == "__main__":
    main()
