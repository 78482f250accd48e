"""The A/B table of run.sh's output: per point each arm's time (ours) and the Triton kernel's (from
the arm that ran it), and each arm's ratio against the first arm's.

    python experiments/world_size_1/small_rows_cluster/table.py OUT base new
"""
import json
import sys


def rows(folder):
    return {(r["hidden"], r["top_k"], r["mode"], r["profile"], r["tokens"]): r["us"]
            for r in json.load(open(f"{folder}/summary.json"))["rows"]}


def main(out, arms):
    runs = {a: rows(f"{out}/{a}") for a in arms}
    base = arms[0]
    print("| H | top_k | L2 | profile | T | " + " | ".join(arms) + " | triton | " +
          " | ".join(f"{a}/{base}" for a in arms[1:]) + " | triton/" + arms[-1] + " |")
    print("|" + "---|" * (6 + 2 * len(arms)))
    for key in sorted(runs[base]):
        us = [runs[a].get(key, {}).get("ours") for a in arms]
        if any(v is None for v in us):
            continue  # a point the budget left out of a run
        tri = next((runs[a][key].get("triton_fused") for a in arms if runs[a][key].get("triton_fused")), None)
        cells = [f"{v:.2f}" for v in us] + [f"{tri:.2f}" if tri else "-"]
        cells += [f"{v / us[0]:.3f}" for v in us[1:]] + [f"{tri / us[-1]:.2f}x" if tri else "-"]
        print("| %d | %d | %s | %s | %d | " % key + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
