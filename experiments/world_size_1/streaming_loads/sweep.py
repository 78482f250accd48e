"""Experiment: the streaming program's variants (one tree each, this process imports one), graph replay as tune measures."""
import json, os, sys, time, statistics
import torch
import dispatch
from moe_ar_tools.tune.gpu import RankMeasurer
from moe_ar_tools.tune.units import Unit

variant, tag, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
out = os.environ["OUT"]
deadline = time.time() + budget
res = []
tokens = [2048, 4096, 1024, 8192, 512]
profiles = ["plain", "nvfp4", "fp8_group128", "fp8_tensor"]
m = RankMeasurer(world_size=1, rank=0, dtype="bf16", max_tokens=8192, reps=15, calls=10, warmup=3, seed=1234)
for T in tokens:
    for prof in profiles:
        if time.time() > deadline:
            break
        u = Unit(1, "bf16", 7168, 8, True, T, prof)
        try:
            r = m.measure(u)
        except Exception as e:
            print("ERR", u, e); continue
        for name, got in r.items():
            med = statistics.median(got["replay_us"]) if got["replay_us"] else None
            res.append(dict(variant=variant, tag=tag, T=T, profile=prof, program=name, us=med, reasons=got["reasons"]))
            print(variant, T, prof, name, None if med is None else round(med, 2), got["reasons"][:1], flush=True)
json.dump(res, open(f"{out}/cap_{variant}_{tag}.json", "w"), indent=0)
