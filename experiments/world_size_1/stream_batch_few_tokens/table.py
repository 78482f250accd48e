"""An A/B table from the arms' summary.json: base, new, base again, new again (default the arms of
this folder's ab.py; ../stream_natural_order/ab_natural.py's are base nat1 base2 nat1b).
    python experiments/world_size_1/stream_batch_few_tokens/table.py bench_results/world_size_1/stream_batch_few_tokens/ab
    python experiments/world_size_1/stream_batch_few_tokens/table.py bench_results/world_size_1/stream_natural_order/ab base nat1 base2 nat1b"""
import json
import sys

d = sys.argv[1]
arms = sys.argv[2:6] if len(sys.argv) > 2 else ["base", "b4", "base2", "b4b"]
rows = {a: {(r["mode"], r["profile"], r["tokens"]): r for r in json.load(open(f"{d}/{a}/summary.json"))["rows"]}
        for a in arms}
print(f"| L2 | profile | T | {arms[0]} | {arms[2]} | {arms[1]} | {arms[3]} | {arms[1]} / {arms[0]} (faster runs) "
      f"| Triton / {arms[0]} |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for k in sorted(rows[arms[0]]):
    b = [rows[a][k]["us"]["ours"] for a in arms]
    tri = rows[arms[0]][k]["us"].get("triton_fused")
    base, new = min(b[0], b[2]), min(b[1], b[3])
    print(f"| {k[0]} | {k[1]} | {k[2]} | {b[0]:.2f} | {b[2]:.2f} | {b[1]:.2f} | {b[3]:.2f} | {new / base:.3f} | "
          + (f"{tri / base:.2f} |" if tri else "- |"))
