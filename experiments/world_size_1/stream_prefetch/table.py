"""The A/B table of stream_indices/ab.sh's output (each arm's summary.json): ours (no PDL) per point, the mean of each tree's
two runs (NAME and NAMEb), and each tree's ratio against the first.

    python experiments/world_size_1/stream_prefetch/table.py OUT v0,v1,v2,v3
"""
import json
import sys


def medians(folder):
    rows = json.load(open(f"{folder}/summary.json"))["rows"]
    return {(r["hidden"], r["mode"], r["profile"], r["tokens"]): r["us"]["ours"] for r in rows
            if r["us"].get("ours") is not None}


def main(out, arms):
    runs = {name: medians(f"{out}/{name}") for arm in arms for name in (arm, arm + "b")}
    base = arms[0]
    print("| H | L2 | profile | T | " + " | ".join(arms) + " | " + " | ".join(f"{a}/{base}" for a in arms[1:]) + " |")
    print("|" + "---|" * (4 + 2 * len(arms) - 1))
    for key in sorted(runs[base]):
        pairs = {a: (runs[a].get(key), runs[a + "b"].get(key)) for a in arms}
        if any(None in pair for pair in pairs.values()):
            continue  # a point the budget left out of a run
        mean = {a: sum(pair) / 2 for a, pair in pairs.items()}
        print("| %d | %s | %s | %d | " % key + " | ".join(f"{mean[a]:.2f}" for a in arms) + " | "
              + " | ".join(f"{mean[a] / mean[base]:.3f}" for a in arms[1:]) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
