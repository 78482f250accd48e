"""Probe for the open PDL-burst timeouts in emulation (bench_results/gpu_tests/README.md).

    OUT=dir PYTHONPATH=. python3 experiments/gpu_tests/pdl-burst-timeouts/gpu_burst_probe.py SEED SECONDS DEVICES
        (e.g. 1 40 0,0 or 2 40 0,1)

from the repository root (it builds its calls with tests/test_gpu_correctness.py's helpers).

Bursts of 8 calls of an emulated world of 2 (fp16, auto selection, every quant), each rank's calls
launched one by one on its own stream with no join between calls, as separate processes would; four
variants in turn: PDL mixed, off, on, and mixed without NVFP4 (under the tables it was written for:
no one-shot above 256 tokens). A burst that fails (a rank times out, 2 s deadline) is recorded with
its calls; the JSON counts bursts and failures per variant. Not a test: it reports, it does not
assert.

PROBE_NO_CARVEOUT=1 leaves out the launcher's request for the largest shared-memory carveout when
ranks share a GPU, to see whether that request is what ended these timeouts. Without it, a burst
that mixes a row-ring program with a two-shot can also time out for the reason that request fixed:
a failure's `meta` names each call's program, which tells the two apart.
"""
import json
import os
import pathlib
import random
import sys
import time

import torch

import dispatch
from dispatch import registry
from moe_ar_tools import reference as ref

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests"))
import test_gpu_correctness as tgc  # noqa: E402  (the GPU tests' call builder)

WORLD_SIZE, DTYPE_NAME = 2, "fp16"
CALLS_PER_BURST = 8
VARIANTS = ("pdl_mixed", "pdl_off", "pdl_on", "no_big_oneshot")


def main(argv) -> None:
    if os.environ.get("PROBE_NO_CARVEOUT"):
        registry.LoadedProgram.prefer_largest_shared_memory = lambda self: None
    out_dir = os.environ.get("OUT", ".")
    W, dtype = WORLD_SIZE, ref.NAME_TO_DTYPE[DTYPE_NAME]
    devices = [int(x) for x in argv[3].split(",")] if len(argv) > 3 else [0, 0]
    world = dispatch.EmulatedWorld(W, tgc.AUTO_MAX_TOKENS, tgc.AUTO_HIDDEN, dtype, timeout_s=2.0, devices=devices)
    tgc.DEVICE = "cuda:0"
    for d in sorted(set(devices)):
        dispatch.warmup([s.name for s in tgc.SPECS if s.world_size == W and s.dtype == DTYPE_NAME], device_index=d)
    # asserts, as the auto test does, that the shared-expert variant never leaves the protocol class
    tgc.regime_boundaries(dispatch, world.workspaces[0], tgc.AUTO_MAX_TOKENS)
    streams = [torch.cuda.Stream(device=d) for d in devices]
    report = []
    rnd = random.Random(int(argv[1]) if len(argv) > 1 else 1)
    t_end = time.time() + (float(argv[2]) if len(argv) > 2 else 60)
    counts = {v: {"bursts": 0, "calls": 0, "timeouts": 0} for v in VARIANTS}
    bursts = 0
    while time.time() < t_end:
        variant = VARIANTS[bursts % len(VARIANTS)]
        bursts += 1
        calls, meta = [], []
        for j in range(CALLS_PER_BURST):
            T = rnd.choice([rnd.randint(1, 256), rnd.randint(257, 1024), rnd.randint(1025, 1536),
                            rnd.randint(200, 300)])
            quant = rnd.choice(tgc.QUANTS)
            if variant == "no_big_oneshot" and quant == "nvfp4":
                quant = None
            pdl = {"pdl_off": False, "pdl_on": True}.get(variant, rnd.random() < 0.5)
            case = tgc._random_call_case(W, T, tgc.AUTO_HIDDEN, dtype, rnd.getrandbits(60), rnd,
                                         device=[f"cuda:{d}" for d in devices] if devices[0] != devices[1] else None)
            call = tgc.prepare_call(case, quant=quant, programs=None, pdl=pdl, nvfp4_device="same",
                                    label=f"{variant} {j}")
            calls.append(call)
            has_shared = case.meta["shared"] != "none"
            meta.append(dict(T=T, quant=quant, pdl=pdl, shared=case.meta["shared"],
                             program=dispatch.select_program(world.workspaces[0], T, quant, has_shared)))
        for d, stream in zip(devices, streams):
            stream.wait_stream(torch.cuda.current_stream(d))
        # each rank's calls in order, the ranks interleaved at random, no join between calls
        order = [r for r in range(W) for _ in calls]
        rnd.shuffle(order)
        next_call = [0] * W
        done_events = [[None] * len(calls) for _ in range(W)]
        launch_order = []
        for r in order:
            call = calls[next_call[r]]
            with torch.cuda.stream(streams[r]):
                call["outs"] = call.get("outs") or [None] * W
                call["outs"][r] = dispatch.moe_finalize_allreduce(world.workspaces[r], **call["kwargs"][r])
                event = torch.cuda.Event()
                event.record(streams[r])
                done_events[r][next_call[r]] = event
            launch_order.append((r, next_call[r]))
            next_call[r] += 1
        t0 = time.time()
        while time.time() - t0 < 6 and not all(e.query() for row in done_events for e in row):
            time.sleep(0.01)
        done = [[e.query() for e in row] for row in done_events]
        counts[variant]["bursts"] += 1
        counts[variant]["calls"] += len(calls)
        if not all(all(row) for row in done):
            counts[variant]["timeouts"] += 1
            for d in set(devices):
                torch.cuda.synchronize(d)
            errors = [w._moe_ar_state.memory.error.tolist() for w in world.workspaces]
            states = [w._moe_ar_state.memory.read_state().tolist() for w in world.workspaces]
            report.append(dict(variant=variant, meta=meta, done=done, errors=errors, states=states,
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
            for call in calls:
                ref.check_outputs(call["case"], call["outs"], call["provided"], quant=call["quant"],
                                  global_scale=call["gs"], ref=call["ref"], nvfp4_device=call["nvfp4_device"],
                                  label=call["label"], **call["fp8"])
        except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
            print("CHECK FAILED", variant, str(e)[:500], flush=True)
            report.append(dict(variant=variant, meta=meta, check=str(e)[:2000]))
            world.reset()
    print(json.dumps(counts), flush=True)
    path = os.path.join(out_dir, f"burst_debug_{'_'.join(map(str, devices))}.json")
    with open(path, "w") as fh:
        json.dump(dict(counts=counts, report=report), fh, indent=1)


if __name__ == "__main__":
    main(sys.argv)
