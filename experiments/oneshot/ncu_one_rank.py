"""One rank's kernel with its peer's partials already in place, for Nsight Compute.

ncu runs kernels one at a time, so two ranks that wait for each other cannot both run under it. Here
world size 2 runs over two GPUs (each rank's grid as in a real run, one rank a GPU) and the calls
are made one rank at a time with a short deadline:

    A1  rank 1 alone: sends its partials to rank 0, waits for rank 0, gives up at the deadline
    A0  rank 0: finds A1's partials, never waits
    B1  as A1, next call
    B0  as A0, and it clears A0's buffer as every call clears the one before: the kernel to profile

All four calls are prepared first (a rank that timed out refuses new calls until reset). Only for
programs whose ranks exchange once per call (one-shot): the two-shots' ranks wait for each other a
second time, so their profiled rank times out (the pipelined two-shot:
experiments/pipelined/solo/pipelined_solo_rank.py, one rank with its receive buffers pre-filled). Kernel times under ncu are not the bench's (ncu's
own overhead adds ~170 us to each); read instruction counts, SM active cycles and stall reasons.

    PYTHONPATH=. ncu --clock-control none --kernel-name regex:moe_ar_ --launch-skip 3 --launch-count 1 --set full \\
        -o os111_512 python3 experiments/oneshot/ncu_one_rank.py --program moe_ar_oneshot_bf16_ws2_nvfp4 \\
        --quant nvfp4 --tokens 512
"""
import argparse
import sys

import torch

import dispatch
from dispatch.op import prepare_call
from moe_ar_tools import reference as ref


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", required=True, help="a one-shot program of world size 2")
    parser.add_argument("--quant", default="none", choices=["none", "nvfp4", "fp8_group128"])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    quant = None if args.quant == "none" else args.quant
    devices = ["cuda:0", "cuda:1"]
    world = dispatch.EmulatedWorld(2, max(args.tokens, 16), args.hidden, torch.bfloat16, devices=devices,
                                   timeout_s=0.05)

    def per_rank_kwargs(seed):
        case = ref.make_case(2, args.tokens, args.hidden, args.top_k, torch.bfloat16, seed=seed, device=devices,
                             shared=True)
        per_rank = []
        for r, inputs in enumerate(case):
            kwargs = dict(inputs, quant=quant, program=args.program)
            if quant == "nvfp4":
                kwargs["global_scale"] = torch.tensor([ref.typical_global_scale(inputs["residual_in"])],
                                                      dtype=torch.float32, device=devices[r])
            per_rank.append(kwargs)
        return per_rank

    first = [prepare_call(ws, dict(kw)) for ws, kw in zip(world.workspaces, per_rank_kwargs(1))]
    second = [prepare_call(ws, dict(kw)) for ws, kw in zip(world.workspaces, per_rank_kwargs(2))]
    for call, rank in ((first[1], 1), (first[0], 0), (second[1], 1), (second[0], 0)):
        with torch.cuda.stream(world.streams[rank]):
            call.launch()
        torch.cuda.synchronize(rank)
    try:
        world.workspaces[0].check()
    except RuntimeError as e:
        print(f"rank 0 timed out, the profile is of a waiting kernel: {e}", file=sys.stderr)
        return 1
    print("rank 0 completed without waiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
