"""The probe's tables from run.sh's arms (OUT/<arm>/summary.json, arms.tgz unpacked), one or more runs:
per point, each arm's automatic choice and forced programs (us), the Triton kernel, and ratios.
    python experiments/world_size_1/few_routes_group/table.py RUN_DIR [RUN_DIR ...]"""
import json
import pathlib
import statistics
import sys


def load(run, arm):
    path = pathlib.Path(run) / arm / "summary.json"
    if not path.exists():
        return {}
    rows = {}
    for r in json.load(open(path))["rows"]:
        progs = r.get("programs") or {}
        rows[(r["mode"], r["profile"], r["hidden"], r["top_k"], r["tokens"])] = {
            "auto": r["us"].get("ours"), "tri": r["us"].get("triton_fused"),
            "lat": next((v for k, v in progs.items() if "streaming" not in k), None),
            "st": next((v for k, v in progs.items() if "streaming" in k), None),
            "kind": "st" if "streaming" in (r.get("program") or "") else "lat"}
    return rows


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def f(v, d=2):
    return "-" if v is None else f"{v:.{d}f}"


def main(runs):
    arms = {a: [load(r, a) for r in runs] for a in ("new", "old", "bs", "newb", "lat", "bsb")}
    for a in ("base7", "lean7"):  # an A/B/A/B: each arm's second pass is its "b" arm
        arms[a] = [load(r, name) for r in runs for name in (a, a + "b")]
    print(f"runs: {', '.join(runs)}; us a call, the mean over the runs that have the arm\n")
    print("## FP8 group-128's few-routes build (new) against the tree before it (old), and the Triton kernel\n")
    print("| L2 | H | top_k | T | old auto (program) | new auto (program) | new / old | old streaming | new streaming | "
          "new latency | Triton | new auto / Triton |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    keys = sorted({k for run in arms["new"] for k in run if k[1].startswith("fp8_group")},
                  key=lambda k: (k[0], -k[2], k[3], k[4]))
    for k in keys:
        get = lambda arm, field: mean([run.get(k, {}).get(field) for run in arms[arm]])
        kind = lambda arm: next((run[k]["kind"] for run in arms[arm] if k in run), "-")
        na, oa, tri = get("new", "auto"), get("old", "auto"), get("new", "tri")
        print(f"| {k[0]} | {k[2]} | {k[3]} | {k[4]} | {f(oa)} ({kind('old')}) | {f(na)} ({kind('new')}) | "
              f"{f(na / oa if na and oa else None, 3)} | {f(get('old', 'st'))} | {f(get('new', 'st'))} | "
              f"{f(get('new', 'lat'))} | {f(tri)} | {f(na / tri if na and tri else None, 3)} |")
    for title, a, b in (("The sums of squares a barrier and the zero butterfly steps fewer (bs) against new", "new", "bs"),
                        ("The same at top_k 8", "newb", "bsb"),
                        ("The latency program's shape builds to 1,024 tokens (lat) against new, top_k 8", "newb", "lat"),
                        ("lean_stream_sum.patch (lean7) against this tree (base7)", "base7", "lean7")):
        if not any(arms[a]):
            continue
        print(f"\n## {title}\n")
        print(f"| L2 | profile | H | top_k | T | {a} auto | {b} auto | {b} / {a} auto | {b} / {a} latency | "
              f"{b} / {a} streaming | {a} auto / Triton |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        keys = sorted({k for run in arms[a] for k in run}, key=lambda k: (k[0], k[1], -k[2], k[3], k[4]))
        for k in keys:
            get = lambda arm, field: mean([run.get(k, {}).get(field) for run in arms[arm]])
            ratio = lambda field: (lambda x, y: f(y / x if x and y else None, 3))(get(a, field), get(b, field))
            tri = get(a, "tri") or get("new", "tri")
            print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {f(get(a, 'auto'))} | {f(get(b, 'auto'))} | "
                  f"{ratio('auto')} | {ratio('lat')} | {ratio('st')} | "
                  f"{f(get(a, 'auto') / tri if get(a, 'auto') and tri else None, 3)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
