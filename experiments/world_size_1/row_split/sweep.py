"""Experiment: world size 1, both local programs under each row split (vec_per_thread), graph replay as tune measures."""
import json, os, sys, time, statistics
import torch
import dispatch
from moe_ar_tools.tune.gpu import RankMeasurer
from moe_ar_tools.tune.units import Unit

out = os.environ["OUT"]
deadline = time.time() + float(sys.argv[1] if len(sys.argv) > 1 else 480)
res = []
shapes = [(7168, 8, True), (4096, 8, False)]
tokens = [2048, 1024, 4096, 256, 1, 512]
profiles = ["plain", "nvfp4"]
vpts = [None, 1, 2, 3, 4]
m = RankMeasurer(world_size=1, rank=0, dtype="bf16", max_tokens=16384, reps=20, calls=10, warmup=3, seed=1234)
wss = {vpt: {H: dispatch.LocalWorkspace(max_tokens=16384, hidden=H, dtype=torch.bfloat16, vec_per_thread=vpt)
             for (H, _, _) in shapes if not (H == 7168 and vpt == 1)} for vpt in vpts}
for T in tokens:
    for (H, K, sh) in shapes:
        for prof in profiles:
            for vpt in vpts:
                if time.time() > deadline:
                    break
                if H == 7168 and vpt == 1:
                    continue
                u = Unit(1, "bf16", H, K, sh, T, prof)
                try:
                    m.workspaces = wss[vpt]
                    r = m.measure(u)
                except Exception as e:
                    print("ERR", u, vpt, e); continue
                for name, got in r.items():
                    med = statistics.median(got["replay_us"]) if got["replay_us"] else None
                    res.append(dict(H=H, K=K, shared=sh, T=T, profile=prof, vpt=vpt, program=name, us=med,
                                    reasons=got["reasons"]))
                    print(H, T, prof, vpt, name, None if med is None else round(med, 2), got["reasons"][:1], flush=True)
        json.dump(res, open(f"{out}/vpt_sweep.json", "w"), indent=0)
json.dump(res, open(f"{out}/vpt_sweep.json", "w"), indent=0)
