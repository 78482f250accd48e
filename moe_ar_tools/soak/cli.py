"""The command (moe-ar-soak, python -m moe_ar_tools.soak): its options, and the run."""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

import moe_ar_tools.soak as soak_package
from moe_ar_tools import reference as ref
from moe_ar_tools.soak.result import summary_line, write_result
from moe_ar_tools.soak.runner import Soak


def parse_devices(spec, world_size: int):
    """'0,1' -> each rank's GPU index, repeated to world_size entries (0,1 for 4 ranks: 0,1,0,1);
    None or '' -> None (every rank on the current GPU)."""
    if spec is None or str(spec).strip() == "":
        return None
    try:
        devs = [int(x) for x in str(spec).split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"devices: {spec!r} is not a comma-separated list of GPU indices") from None
    if not devs or any(d < 0 for d in devs):
        raise ValueError(f"devices: {spec!r} is not a comma-separated list of GPU indices")
    if len(devs) > world_size:
        raise ValueError(f"devices: {len(devs)} entries for world size {world_size}")
    return [devs[r % len(devs)] for r in range(world_size)]


def parse_quants(spec: str) -> list:
    out = []
    for q in str(spec).split(","):
        q = q.strip().lower()
        if q in ("none", "plain"):
            out.append(None)
        elif q == "nvfp4":
            out.append("nvfp4")
        else:
            raise ValueError(f"quants: {q!r} (use none and/or nvfp4)")
    if not out:
        raise ValueError("quants: empty")
    return list(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-ar-soak", description=soak_package.__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--world-size", type=int, required=True, help="ranks of the emulated world (2, 4 or 8)")
    add("--devices", default=None,
        help="each rank's GPU, comma separated, repeated to the world size (default: all on GPU 0)")
    add("--calls", type=int, default=100_000, help="calls to make, fewer if the time budget ends first (100000)")
    add("--time-budget-s", type=float, default=600.0, help="start no call after this many seconds (600)")
    add("--out", default=None, help="JSON result path (default: print it)")
    add("--dtype", choices=sorted(ref.NAME_TO_DTYPE), default="bf16", help="(bf16)")
    add("--hidden", type=int, default=2048, help="(2048)")
    add("--max-tokens", type=int, default=None,
        help="default: max(2048, the last regime boundary of the selection table + 255, rounded to 128)")
    add("--oneshot-max-tokens", type=int, default=None, help="the workspaces' one-shot capacity")
    add("--quants", default="none,nvfp4", help="output profiles to draw from (none,nvfp4)")
    add("--graph-fraction", type=float, default=0.5,
        help="share of calls replayed from CUDA graphs, single-device worlds only (0.5)")
    add("--graph-configs-per-bucket", type=int, default=1,
        help="captured option sets per (regime T bucket, profile, PDL) (1)")
    add("--full-check-every", type=int, default=200,
        help="full check against the float64 reference every N calls (200)")
    add("--check-every", type=int, default=1000, help="world.check() (timeouts) every N calls (1000)")
    add("--timeout-s", type=float, default=10.0, help="the workspaces' peer-wait deadline (10)")
    add("--seed", type=int, default=None, help="default: fresh (recorded in the JSON)")
    add("--no-progress", action="store_true", help="no progress bar / lines")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.world_size < 2:
            raise ValueError(f"world-size: {args.world_size}")
        args.device_list = parse_devices(args.devices, args.world_size)
        args.quant_list = parse_quants(args.quants)
        if args.calls < 1:
            raise ValueError(f"calls: {args.calls} < 1")
        if args.hidden <= 0 or args.hidden % 16:
            raise ValueError(f"hidden: {args.hidden} must be a positive multiple of 16")
        if args.max_tokens is not None and args.max_tokens < 1:
            raise ValueError(f"max-tokens: {args.max_tokens}")
        if not 0.0 <= args.graph_fraction <= 1.0:
            raise ValueError(f"graph-fraction: {args.graph_fraction} not in [0, 1]")
        if args.full_check_every < 1 or args.check_every < 1 or args.graph_configs_per_bucket < 1:
            raise ValueError("full-check-every, check-every and graph-configs-per-bucket must be >= 1")
    except ValueError as e:
        parser.error(str(e))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2 ** 62)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe-ar-soak: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    soak = Soak(args)
    result = soak.run()
    write_result(result, args.out)
    print(summary_line(result), flush=True)
    if result["hangs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # a kernel may still spin: do not wait for the CUDA context to go down
    return 0 if result["passed"] else 1
