"""The pipelined two-shot's rank 0 alone, its receive buffers pre-filled so that it never waits
(an infinitely fast peer), against the pair of ranks; same inputs, one process, two GPUs.
Shape: bf16, H 7168, top_k 8 + shared expert, no dropped routes.

Its two uses:
  * timing: if rank 0 alone is as slow as the pair, the exchange costs nothing and the time goes
    to the rank's own memory traffic (it was: 0.98-1.04 of the pair from 1,024 to 8,192 tokens,
    bench_results/pipelined/solo/);
  * Nsight Compute: ncu runs kernels one at a time, so the two ranks of a pair cannot both run
    under it (ncu_one_rank.py beside this works only for the one-shot); a rank that never waits can.

    PYTHONPATH=. python3 experiments/pipelined/solo/pipelined_solo_rank.py --out solo.json
    PYTHONPATH=. ncu --clock-control none --kernel-name regex:moe_ar_ --set full -o tsp8192 \
        python3 experiments/pipelined/solo/pipelined_solo_rank.py --ncu --tokens 8192 \
        --programs moe_ar_twoshot_pipelined_bf16_ws2_plain:none

Kernel times under ncu are longer than in the timing mode (300 against 133 us at 2,048 tokens):
read ncu for stall reasons, bytes and instruction counts, not durations. Rank 0's writes to its
peer still cross NVLink; what it reads from its own buffers comes from HBM, where a pair finds
the peer's vectors in L2.
"""
import argparse
import json
import os
import statistics
import sys

import cupy
import torch

import dispatch
from dispatch.op import prepare_call
from dispatch.rank_memory import STATE_WORDS
from moe_ar_tools import reference as ref

FILL = 0x3F803F80  # two bf16 1.0: never the sentinel


def calls_for(world, T, program, quant, seed=1):
    devices = ["cuda:0", "cuda:1"]
    case = ref.make_case(2, T, 7168, 8, torch.bfloat16, seed=seed, device=devices, shared=True, drop_frac=0.0,
                         poison_unused_rows=False)
    calls = []
    for r, inputs in enumerate(case):
        kwargs = dict(inputs, quant=quant, program=program)
        if quant == "nvfp4":
            kwargs["global_scale"] = torch.tensor([1.0], dtype=torch.float32, device=devices[r])
        calls.append(prepare_call(world.workspaces[r], kwargs))
    return calls


def prefill(ws, stream):
    """Every buffer of rank 0 holds payload (no sentinel: no wait), and its state is call 0."""
    memory = ws._moe_ar_state.memory
    with cupy.cuda.Device(0), cupy.cuda.ExternalStream(stream.cuda_stream):
        buffers = cupy.cuda.UnownedMemory(memory.buffers, memory.buffer_bytes, memory, 0)
        cupy.ndarray((memory.buffer_bytes // 4,), cupy.uint32, cupy.cuda.MemoryPointer(buffers, 0)).fill(FILL)
        state = cupy.cuda.UnownedMemory(memory.state, STATE_WORDS * 4, memory, 0)
        cupy.ndarray((STATE_WORDS,), cupy.uint32, cupy.cuda.MemoryPointer(state, 0)).fill(0)


def solo_times(world, call0, reps):
    """us per call of rank 0 alone: three calls after each prefill (buffers 0, 1, 2)."""
    stream = world.streams[0]
    out = []
    for _ in range(reps):
        prefill(world.workspaces[0], stream)
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):  # buffers 0, 1, 2: each pre-filled
                call0.launch()
            end.record()
        torch.cuda.synchronize(0)
        out.append(start.elapsed_time(end) * 1e3 / 3)
    world.workspaces[0].check()
    return out


def pair_times(world, calls, reps, batch=30):
    """us per call of both ranks, `batch` calls back to back, the slower rank's time."""
    world.reset()
    out = []
    for _ in range(reps):
        starts = []
        for r in (1, 0):
            with torch.cuda.stream(world.streams[r]):
                torch.cuda._sleep(2_000_000)  # let the host queue every launch first
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                starts.append(start)
        for _ in range(batch):
            for r in (1, 0):
                with torch.cuda.stream(world.streams[r]):
                    calls[r].launch()
        ends = []
        for r in (1, 0):
            with torch.cuda.stream(world.streams[r]):
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                ends.append(end)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        out.append(max(start.elapsed_time(end) for start, end in zip(starts, ends)) * 1e3 / batch)
    for ws in world.workspaces:
        ws.check()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON of the timings")
    parser.add_argument("--ncu", action="store_true", help="one solo launch per program and token count, no timing")
    parser.add_argument("--tokens", default="1024,2048,4096,8192")
    parser.add_argument("--programs", default="moe_ar_twoshot_pipelined_bf16_ws2_plain:none,moe_ar_twoshot_pipelined_bf16_ws2_nvfp4:nvfp4",
                    help="program:quant,... (quant: none, nvfp4)")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    progs = [p.split(":") for p in args.programs.split(",")]
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    world = dispatch.EmulatedWorld(2, max(tokens), 7168, torch.bfloat16, devices=["cuda:0", "cuda:1"], timeout_s=2.0)
    results = []
    for name, q in progs:
        quant = None if q == "none" else q
        for T in tokens:
            calls = calls_for(world, T, name, quant)
            if args.ncu:
                prefill(world.workspaces[0], world.streams[0])
                with torch.cuda.stream(world.streams[0]):
                    calls[0].launch()
                torch.cuda.synchronize(0)
                world.workspaces[0].check()
                print(f"solo launch done {name} {T}", flush=True)
                continue
            solo = solo_times(world, calls[0], args.reps)
            pair = pair_times(world, calls, args.reps)
            rec = dict(program=name, tokens=T, solo_us=statistics.median(solo), pair_us=statistics.median(pair),
                       solo_all=solo, pair_all=pair)
            results.append(rec)
            print(f"{name} T={T}: solo {rec['solo_us']:.1f} us, pair {rec['pair_us']:.1f} us, "
                  f"solo/pair {rec['solo_us'] / rec['pair_us']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(commit=os.environ.get("COMMIT"), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
