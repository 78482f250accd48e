"""ab.py's table: us a call (the faster of each arm's two runs), each variant over c, NVFP4 over plain.
    python experiments/world_size_1/nvfp4_setup/table.py bench_results/world_size_1/nvfp4_setup/run1"""
import json
import os
import sys

d = sys.argv[1]
arms = ["c", "pad16", "under", "under_pad16", "nopad"]


def rows(arm):
    path = f"{d}/{arm}/summary.json"
    if not os.path.exists(path):
        return {}
    return {(r["mode"], r["profile"], r["tokens"]): r["us"]["ours"] for r in json.load(open(path))["rows"]}


runs = {a: [rows(a), rows(a + "_b")] for a in arms}
best = {a: {} for a in arms}
for a in arms:
    for k in set(runs[a][0]) | set(runs[a][1]):
        v = [r[k] for r in runs[a] if r.get(k) is not None]
        if v:
            best[a][k] = min(v)
print("| L2 | T | plain | " + " | ".join(arms) + " | " + " | ".join(f"{a} / c" for a in arms[1:])
      + " | c / plain | best / plain |")
print("|---|---:|" + "---:|" * (2 * len(arms) + 2))
for mode, _, T in sorted(k for k in best["c"] if k[1] == "nvfp4"):
    plain = best["c"].get((mode, "plain", T))
    us = [best[a].get((mode, "nvfp4", T)) for a in arms]
    cell = lambda x: f"{x:.2f}" if x else "-"
    ratio = [f"{u / us[0]:.3f}" if u and us[0] else "-" for u in us[1:]]
    shipped = min((u for u in us[:4] if u), default=None)  # nopad ships nowhere
    tail = f" | {us[0] / plain:.3f} | {shipped / plain:.3f} |" if plain and us[0] and shipped else " | - | - |"
    print(f"| {mode} | {T} | {cell(plain)} | " + " | ".join(cell(u) for u in us) + " | " + " | ".join(ratio) + tail)
