"""The command (moe-ar-bench, python -m moe_ar_tools.bench): parse the options, measure the cold
start if asked, and spawn one worker process per GPU for the sweep."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import time

import click

from moe_ar_tools.bench.cold_start import measure_cold_start
from moe_ar_tools.bench.config import (DEFAULT_SHAPES, DEFAULT_SYSTEMS, DEFAULT_TOKENS, DTYPE_BYTES, PROFILES,
                                       REQUIRED_ENV, SYSTEM_CHOICES, Config, parse_list, parse_shapes, parse_tokens)
from moe_ar_tools.bench.records import _versions, default_out_path
from moe_ar_tools.bench.sweep import Bench
from moe_ar_tools.provenance import git_commit


def _set_required_env() -> None:
    os.environ.update(REQUIRED_ENV)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cfg: Config) -> None:
    """One process per GPU: NCCL group over TCP on localhost, a gloo group for CPU agreement."""
    _set_required_env()
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    # Timeouts: a deadlock fails (and mp.spawn stops the other ranks) instead of hanging the run.
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("nccl", init_method=cfg.init_method, rank=rank, world_size=cfg.world,
                            device_id=torch.device("cuda", rank), timeout=timeout)
    try:
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        Bench(cfg, rank, gloo).run()
        dist.barrier(group=gloo)
    finally:
        dist.destroy_process_group()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--world", default=2, help="processes / GPUs (one each)")
@click.option("--shapes", default=DEFAULT_SHAPES, help="HIDDEN:TOP_K[:shared], comma separated")
@click.option("--tokens", default=DEFAULT_TOKENS, help="comma separated, or a power-of-two range like 1-16384")
@click.option("--profiles", default="plain,nvfp4", help="output profiles: plain (dtype outputs), nvfp4 (+ NVFP4), "
                                                   "fp8_group128, fp8_tensor")
@click.option("--dtype", type=click.Choice(["bf16", "fp16"]), default="bf16")
@click.option("--systems", default=DEFAULT_SYSTEMS,
              help="of nccl+torch, symm+torch, nccl+compiled, symm+compiled, auto, auto+quant, programs "
                   "(every generated program), or program names")
@click.option("--reps", default=50, help="timed replays per system and point (docs/measurement.md: at least 50)")
@click.option("--calls", default=10, help="back-to-back calls captured in one CUDA graph")
@click.option("--warmup", default=3, help="eager calls before capture")
@click.option("--out", default=None, help="JSON path [default: bench_results/<machine>-<date>.json]; "
                                          "the PNG plot goes beside it")
@click.option("--machine", default=None, help="machine name for the results [default: $MOE_AR_MACHINE or "
                                              "<W>x<GPU>-<hostname>]")
@click.option("--timeout-s", default=30.0, help="the workspaces' peer-wait deadline")
@click.option("--seed", default=1234)
@click.option("--bw-gib", default=2.0, help="GiB per copy in the bandwidth measurement")
@click.option("--time-budget-s", default=420.0, help="start no new token count after this many seconds "
                                                     "from launch (the JSON says truncated)")
@click.option("--cold-start/--no-cold-start", default=False,
              help="also measure compiling one program at first use and loading it from the warm cache")
@click.option("--cold-start-program", default=None, help="[default: the auto choice at 1 token, profile plain]")
@click.option("--sweep/--no-sweep", default=True, help="run the latency sweep")
@click.option("--pdl/--no-pdl", default=False, help="launch the fused calls with programmatic dependent launch")
@click.option("--vec-per-thread", type=click.IntRange(1, 4), default=None,
              help="the workspaces' row split: 16-byte vectors per thread [default: the runtime's]")
def main(world, shapes, tokens, profiles, dtype, systems, reps, calls, warmup, out, machine, timeout_s, seed,
         bw_gib, time_budget_s, cold_start, cold_start_program, sweep, pdl, vec_per_thread):
    """Benchmark the fused MoE finalize + all-reduce + RMSNorm programs against NCCL and torch
    symmetric-memory baselines on `--world` GPUs of this machine (docs/measurement.md)."""
    started = time.time()
    _set_required_env()
    try:
        cfg = Config(world=world, shapes=parse_shapes(shapes), tokens=parse_tokens(tokens),
                     profiles=parse_list(profiles, PROFILES, "profile"), dtype=dtype,
                     systems=parse_list(systems, what="system"), reps=reps, calls=calls, warmup=warmup, out=out,
                     machine=machine, timeout_s=timeout_s, seed=seed, bw_gib=bw_gib, time_budget_s=time_budget_s,
                     started=started, pdl=pdl, vec_per_thread=vec_per_thread)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if reps < 50:
        click.echo(f"note: --reps {reps} is below the 50 of docs/measurement.md", err=True)
    import dispatch
    for s in cfg.systems:
        if s not in SYSTEM_CHOICES and s not in dispatch.programs():
            raise click.BadParameter(f"system {s!r}: not one of {', '.join(SYSTEM_CHOICES)} nor a program name")
    if cold_start:
        from dispatch import registry, table_sets
        selection = table_sets.for_workspace(dtype, world, cfg.shapes[0].hidden, DTYPE_BYTES[dtype], 0)
        name = cold_start_program or registry.program_for(
            registry.select_family(dtype, world, "plain", 1, False, 1024, bounds=selection.limits("plain")), dtype,
            world, "plain")
        click.echo(f"cold start: {name} ...")
        cfg.cold_start = measure_cold_start(name)
        click.echo(json.dumps(cfg.cold_start, indent=1))
        if not sweep:
            if out:
                path = pathlib.Path(out)
            else:
                path = default_out_path(machine or os.environ.get("MOE_AR_MACHINE") or socket.gethostname(),
                                        datetime.datetime.now())
                path = path.with_name(path.stem + "-cold-start.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"commit": git_commit(), "versions": _versions(),
                                        "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                        "cold_start": cfg.cold_start}, indent=1))
            click.echo(f"wrote {path}")
    if not sweep:
        return
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < world:
        raise click.ClickException(f"--world {world} needs {world} GPUs, this machine has "
                                   f"{torch.cuda.device_count()}")
    if world < 2:
        raise click.ClickException("--world must be at least 2 (emulated worlds are not benchmarked)")
    cfg.init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_worker, args=(cfg,), nprocs=world, join=True)
