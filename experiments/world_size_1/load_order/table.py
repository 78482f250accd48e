"""The A/B table of `ab.py`'s arms: us a call of ours per point in each arm (tree, bound, treeb,
boundb) and bound/tree = (bound + boundb) / (tree + treeb), Markdown, from each arm's summary.json.
    python experiments/world_size_1/load_order/table.py RUN_DIR [RUN_DIR ...] > ab_table.md"""
import json
import pathlib
import sys

ARMS = ("tree", "bound", "treeb", "boundb")
print("| H | top_k | L2 | profile | T | program | tree | bound | treeb | boundb | bound/tree |")
print("|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|")
for run in sys.argv[1:]:
    points = {}
    for arm in ARMS:
        path = pathlib.Path(run) / arm / "summary.json"
        if not path.is_file():
            continue
        for row in json.loads(path.read_text())["rows"]:
            key = (row["hidden"], row["top_k"], row["shared"], row["mode"], row["profile"], row["tokens"])
            points.setdefault(key, {"program": row["program"]})[arm] = row["us"]["ours"]
    for (H, K, shared, mode, profile, T), us in sorted(points.items()):
        if not all(us.get(arm) for arm in ARMS):
            continue
        ratio = (us["bound"] + us["boundb"]) / (us["tree"] + us["treeb"])
        print(f"| {H} | {K}{' + shared' if shared else ''} | {mode} | {profile} | {T} | {us['program'].replace('moe_ar_', '')} | "
              + " | ".join(f"{us[arm]:.2f}" for arm in ARMS) + f" | {ratio:.3f} |")
