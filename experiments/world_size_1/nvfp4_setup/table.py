"""ab.py's tables: us a call (the faster of each arm's two runs), each variant over c; NVFP4 over plain.
    python experiments/world_size_1/nvfp4_setup/table.py RUN_DIR   (ab.py's OUT; call.sh packs it in run.tgz)"""
import json
import os
import sys

d = sys.argv[1]
ARMS = {"nvfp4": ["c", "pad16", "under", "under_pad16", "nopad", "c8"], "plain": ["c", "c8"]}


def rows(arm):
    path = f"{d}/{arm}/summary.json"
    if not os.path.exists(path):
        return {}
    return {(r["mode"], r["profile"], r["tokens"]): r["us"]["ours"] for r in json.load(open(path))["rows"]}


best = {}
for a in ARMS["nvfp4"]:
    runs = [rows(a), rows(a + "_b")]
    best[a] = {k: min(r[k] for r in runs if r.get(k) is not None)
               for k in set(runs[0]) | set(runs[1]) if any(r.get(k) is not None for r in runs)}
cell = lambda x: f"{x:.2f}" if x else "-"
for profile, arms in ARMS.items():
    print(f"\n**{profile}**\n")
    print("| L2 | T | " + " | ".join(arms) + " | " + " | ".join(f"{a} / c" for a in arms[1:])
          + (" | c / plain | best shipped / plain |" if profile == "nvfp4" else " |"))
    print("|---|---:|" + "---:|" * (2 * len(arms) - 1 + (2 if profile == "nvfp4" else 0)))
    for mode, _, T in sorted(k for k in best["c"] if k[1] == profile):
        us = [best[a].get((mode, profile, T)) for a in arms]
        ratio = [f"{u / us[0]:.3f}" if u and us[0] else "-" for u in us[1:]]
        tail = " |"
        if profile == "nvfp4":
            plain = best["c"].get((mode, "plain", T))
            shipped = min((u for a, u in zip(arms, us) if u and a != "nopad"), default=None)  # nopad ships nowhere
            tail = f" | {us[0] / plain:.3f} | {shipped / plain:.3f} |" if plain and us[0] and shipped else " | - | - |"
        print(f"| {mode} | {T} | " + " | ".join(cell(u) for u in us) + " | " + " | ".join(ratio) + tail)
