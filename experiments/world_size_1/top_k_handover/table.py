"""The handover table of run.sh's bench summary: per point the automatic choice, each forced program
and the Triton kernel (us), and which program was fastest.
    python experiments/world_size_1/top_k_handover/table.py OUT/bench/summary.json"""
import json
import sys

doc = json.load(open(sys.argv[1]))
print(f"{doc['gpu']}, commit {doc['commit']}")
print("| L2 | profile | H | top_k | T | auto (program) | latency | streaming | triton_fused | best program / Triton |")
print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
for r in sorted(doc["rows"], key=lambda r: (r["mode"], r["profile"], -r["hidden"], r["top_k"], r["tokens"])):
    progs = r.get("programs") or {}
    lat = next((v for k, v in progs.items() if "streaming" not in k), None)
    st = next((v for k, v in progs.items() if "streaming" in k), None)
    tri = r["us"].get("triton_fused")
    auto = r["us"].get("ours")
    best = min([v for v in (lat, st, auto) if v is not None], default=None)
    kind = "streaming" if "streaming" in (r.get("program") or "") else "latency"
    f = lambda v: "-" if v is None else f"{v:.2f}"
    ratio = "-" if best is None or tri is None else f"{best / tri:.3f}"
    print(f"| {r['mode']} | {r['profile']} | {r['hidden']} | {r['top_k']} | {r['tokens']} | {f(auto)} ({kind}) | "
          f"{f(lat)} | {f(st)} | {f(tri)} | {ratio} |")
