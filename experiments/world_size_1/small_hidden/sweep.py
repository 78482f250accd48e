"""Experiment: lc vs lcs at small hidden sizes, row split 4 (default) and 2 vectors a thread; one variant tree."""
import json, os, sys, time, statistics
import torch
import dispatch
from moe_ar_tools.tune.gpu import RankMeasurer
from moe_ar_tools.tune.units import Unit

variant, tag, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
vpts = [None, 2] if len(sys.argv) < 5 else [None if x == "d" else int(x) for x in sys.argv[4].split(",")]
out = os.environ["OUT"]
BPS = int(os.environ.get("BPS", "0"))
if BPS:  # at most BPS blocks a multiprocessor (the grid), every program
    from dispatch import registry
    _orig = registry.LoadedProgram.max_blocks_per_sm
    registry.LoadedProgram.max_blocks_per_sm = lambda self, t, s=0: min(_orig(self, t, s), BPS)
    variant = f"{variant}_b{BPS}"
deadline = time.time() + budget
points = [(4096, False, 2048), (4096, False, 8192), (2048, False, 4096), (2048, False, 8192), (7168, True, 2048)]
if os.environ.get("POINTS"):
    points = [tuple(int(v) for v in p.split(":")) for p in os.environ["POINTS"].split(",")]
    points = [(h, bool(s), t) for h, s, t in points]
profiles = os.environ.get("PROFILES", "plain,nvfp4,fp8_group128").split(",")
res = []
for vpt in vpts:
    m = RankMeasurer(world_size=1, rank=0, dtype="bf16", max_tokens=8192, reps=15, calls=10, warmup=3, seed=1234)
    if os.environ.get("ONLY"):  # only the cell's programs whose name holds ONLY (e.g. _lcs_)
        _progs = m.programs
        m.programs = lambda unit, _p=_progs: [n for n in _p(unit) if os.environ["ONLY"] in n]
    if vpt is not None:
        def ws(hidden, m=m, vpt=vpt):
            if hidden not in m.workspaces:
                m.workspaces[hidden] = dispatch.LocalWorkspace(max_tokens=m.max_tokens, hidden=hidden, dtype=m.dtype,
                                                               vec_per_thread=vpt)
            return m.workspaces[hidden]
        m.workspace = ws
    for H, sh, T in points:
        for prof in profiles:
            if time.time() > deadline:
                break
            u = Unit(1, "bf16", H, 8, sh, T, prof)
            try:
                r = m.measure(u)
            except Exception as e:
                print("ERR", u, repr(e)[:300], flush=True); continue
            for name, got in r.items():
                med = statistics.median(got["replay_us"]) if got["replay_us"] else None
                res.append(dict(variant=variant, tag=tag, vpt=vpt, H=H, shared=sh, T=T, profile=prof, program=name, us=med,
                                reasons=got["reasons"]))
                print(variant, vpt, H, T, prof, name, None if med is None else round(med, 2), got["reasons"][:1], flush=True)
    del m
    torch.cuda.empty_cache()
json.dump(res, open(f"{out}/sh_{variant}_{tag}.json", "w"), indent=0)
