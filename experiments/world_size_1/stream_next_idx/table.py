"""The A/B table of ../stream_indices/ab.sh's output: per point each arm's time (ours, the mean of its
two runs, NAME and NAMEb) and each arm's ratio against the first arm's.

    python experiments/world_size_1/stream_next_idx/table.py OUT v0,v1
"""
import json
import sys


def medians(folder):
    rows = json.load(open(f"{folder}/summary.json"))["rows"]
    return {(r["hidden"], r["top_k"], r["mode"], r["profile"], r["tokens"]): r["us"].get("ours") for r in rows}


def main(out, arms):
    runs = {name: medians(f"{out}/{name}") for arm in arms for name in (arm, arm + "b")}
    base = arms[0]
    names = [n for a in arms for n in (a, a + "b")]
    print("| H | top_k | L2 | profile | T | " + " | ".join(names) + " | " +
          " | ".join(f"{a}/{base}" for a in arms[1:]) + " |")
    print("|" + "---|" * (5 + len(names) + len(arms) - 1))
    for key in sorted(runs[base]):
        values = [runs[n].get(key) for n in names]
        if any(v is None for v in values):
            continue  # a point the budget left out of a run
        mean = {a: (runs[a][key] + runs[a + "b"][key]) / 2 for a in arms}
        cells = [f"{v:.2f}" for v in values] + [f"{mean[a] / mean[base]:.3f}" for a in arms[1:]]
        print("| %d | %d | %s | %s | %d | " % key + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
