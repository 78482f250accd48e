"""The A/B's table (bench_results/world_size_1/stream_batch_few_tokens/ab_table.md) from the arms' summary.json.
    python experiments/world_size_1/stream_batch_few_tokens/table.py bench_results/world_size_1/stream_batch_few_tokens/ab"""
import json
import sys

d = sys.argv[1]
arms = ["base", "b4", "base2", "b4b"]
rows = {a: {(r["mode"], r["profile"], r["tokens"]): r for r in json.load(open(f"{d}/{a}/summary.json"))["rows"]}
        for a in arms}
print("| L2 | profile | T | base | base, again | 4 routes | 4 routes, again | 4 routes / base (faster runs) "
      "| Triton / base |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for k in sorted(rows["base"]):
    b = [rows[a][k]["us"]["ours"] for a in arms]
    tri = rows["base"][k]["us"].get("triton_fused")
    base, four = min(b[0], b[2]), min(b[1], b[3])
    print(f"| {k[0]} | {k[1]} | {k[2]} | {b[0]:.2f} | {b[2]:.2f} | {b[1]:.2f} | {b[3]:.2f} | {four / base:.3f} | "
          + (f"{tri / base:.2f} |" if tri else "- |"))
