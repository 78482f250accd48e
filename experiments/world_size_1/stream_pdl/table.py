"""The A/B table of ../stream_indices/ab.sh's output with SYSTEMS=ours,ours_pdl: per point each arm's
time without and with PDL (the mean of its two runs, NAME and NAMEb), and each arm's ratios against
the first arm's.

    python experiments/world_size_1/stream_pdl/table.py OUT v0,v1,v2
"""
import json
import sys


def medians(folder):
    rows = json.load(open(f"{folder}/summary.json"))["rows"]
    return {(r["hidden"], r["mode"], r["profile"], r["tokens"]): (r["us"].get("ours"), r["us"].get("ours_pdl"))
            for r in rows}


def main(out, arms):
    runs = {name: medians(f"{out}/{name}") for arm in arms for name in (arm, arm + "b")}
    base = arms[0]
    head = [f"{a} {s}" for a in arms for s in ("", "PDL")] + [f"{a}/{base} {s}" for a in arms[1:] for s in ("", "PDL")]
    print("| H | L2 | profile | T | " + " | ".join(h.strip() for h in head) + " |")
    print("|" + "---|" * (4 + len(head)))
    for key in sorted(runs[base]):
        values = [runs[a].get(key, (None, None)) for a in arms for a in (a, a + "b")]
        if any(v is None for pair in values for v in pair):
            continue  # a point the budget left out of a run
        mean = {a: tuple((runs[a][key][i] + runs[a + "b"][key][i]) / 2 for i in (0, 1)) for a in arms}
        cells = [f"{mean[a][i]:.2f}" for a in arms for i in (0, 1)]
        cells += [f"{mean[a][i] / mean[base][i]:.3f}" for a in arms[1:] for i in (0, 1)]
        print("| %d | %s | %s | %d | " % key + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
