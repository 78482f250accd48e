"""Probe for the open PDL-burst timeouts in emulation (bench_results/gpu_tests/README.md).

    OUT=dir python3 -m moe_ar_tools.probes.gpu_burst_probe SEED SECONDS DEVICES    e.g. 1 40 0,0  or  2 40 0,1

from the repository root (it builds its calls with tests/test_gpu_correctness.py's helpers).

Bursts of 8 calls of an emulated world of 2 (fp16, auto selection, every quant), each rank's calls
launched one by one on its own stream with no join between calls, as separate processes would; four
variants in turn: PDL mixed, off, on, and mixed without NVFP4 (under a2aeffb's tables: no one-shot
above 256 tokens). A burst that fails (a rank times out, 2 s deadline) is recorded with its calls;
the JSON counts bursts and failures per variant. Not a test: it reports, it does not assert.

PROBE_NO_CARVEOUT=1 leaves out the launcher's request for the largest shared-memory carveout when
ranks share a GPU (f6d76c0), to see whether that request is what ended these timeouts. Without it, a
burst that mixes a row-ring program with a two-shot can also time out for f6d76c0's own reason: a
failure's `meta` names each call's program, which tells the two apart.
"""
import json, os, pathlib, random, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
import torch
from moe_ar_tools import reference as ref
import test_gpu_correctness as tgc
import dispatch
from dispatch import registry

if os.environ.get("PROBE_NO_CARVEOUT"):
    registry.LoadedProgram.prefer_largest_shared_memory = lambda self: None

OUT = os.environ.get("OUT", ".")
ws, dname = 2, "fp16"
dtype = ref.NAME_TO_DTYPE[dname]
devices = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0, 0]
world = dispatch.EmulatedWorld(ws, tgc.AUTO_MAX_TOKENS, tgc.AUTO_HIDDEN, dtype, timeout_s=2.0, devices=devices)
tgc.DEVICE = "cuda:0"
for d in sorted(set(devices)):
    dispatch.warmup([s.name for s in tgc.SPECS if s.world_size == ws and s.dtype == dname], device_index=d)
stub_bounds, _ = tgc.regime_boundaries(dispatch, world.workspaces[0], tgc.AUTO_MAX_TOKENS)
streams = [torch.cuda.Stream(device=d) for d in devices]
report = []
rnd = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
t_end = time.time() + float(sys.argv[2]) if len(sys.argv) > 2 else time.time() + 60
variants = ["pdl_mixed", "pdl_off", "pdl_on", "no_big_oneshot"]
counts = {v: {"bursts": 0, "calls": 0, "timeouts": 0} for v in variants}
k = 0
while time.time() < t_end:
    variant = variants[k % len(variants)]; k += 1
    calls, meta = [], []
    for j in range(8):
        T = rnd.choice([rnd.randint(1, 256), rnd.randint(257, 1024), rnd.randint(1025, 1536), rnd.randint(200, 300)])
        quant = rnd.choice(tgc.QUANTS)
        if variant == "no_big_oneshot" and quant == "nvfp4":
            quant = None
        pdl = {"pdl_off": False, "pdl_on": True}.get(variant, rnd.random() < 0.5)
        case = tgc._random_call_case(ws, T, tgc.AUTO_HIDDEN, dtype, rnd.getrandbits(60), rnd,
                                     device=[f"cuda:{d}" for d in devices] if devices[0] != devices[1] else None)
        c = tgc.prepare_call(case, quant=quant, programs=None, pdl=pdl, nvfp4_device="same", label=f"{variant} {j}")
        calls.append(c)
        meta.append(dict(T=T, quant=quant, pdl=pdl, shared=case.meta["shared"],
                         program=dispatch.select_program(world.workspaces[0], T, quant, case.meta["shared"] != "none")))
    for d, s in zip(devices, streams):
        s.wait_stream(torch.cuda.current_stream(d))
    order = [r for r in range(ws) for _ in calls]
    rnd.shuffle(order)
    nxt = [0] * ws
    events = [[None] * len(calls) for _ in range(ws)]
    launch_order = []
    for r in order:
        c = calls[nxt[r]]
        with torch.cuda.stream(streams[r]):
            c["outs"] = c.get("outs") or [None] * ws
            c["outs"][r] = dispatch.moe_finalize_allreduce(world.workspaces[r], **c["kwargs"][r])
            ev = torch.cuda.Event(); ev.record(streams[r]); events[r][nxt[r]] = ev
        launch_order.append((r, nxt[r]))
        nxt[r] += 1
    t0 = time.time()
    while time.time() - t0 < 6 and not all(e.query() for row in events for e in row):
        time.sleep(0.01)
    done = [[e.query() for e in row] for row in events]
    counts[variant]["bursts"] += 1; counts[variant]["calls"] += len(calls)
    if not all(all(d) for d in done):
        counts[variant]["timeouts"] += 1
        for d in set(devices):
            torch.cuda.synchronize(d)
        errs = [w._memory.error.tolist() for w in world.workspaces]
        states = [w._memory.read_state().tolist() for w in world.workspaces]
        report.append(dict(variant=variant, meta=meta, done=done, errors=errs, states=states,
                           launch_order=launch_order))
        print("TIMEOUT", variant, json.dumps(report[-1])[:3000], flush=True)
        world.reset()
        if len(report) >= 4:
            break
        continue
    for d in set(devices):
        torch.cuda.synchronize(d)
    try:
        world.check()
        for c in calls:
            ref.check_outputs(c["case"], c["outs"], c["provided"], quant=c["quant"], global_scale=c["gs"],
                              ref=c["ref"], nvfp4_device=c["nvfp4_device"], label=c["label"], **c["fp8"])
    except Exception as e:
        print("CHECK FAILED", variant, str(e)[:500], flush=True)
        report.append(dict(variant=variant, meta=meta, check=str(e)[:2000]))
        world.reset()
print(json.dumps(counts), flush=True)
json.dump(dict(counts=counts, report=report), open(os.path.join(OUT, f"burst_debug_{'_'.join(map(str, devices))}.json"), "w"), indent=1)
