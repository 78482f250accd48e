"""World size 2+'s run: the names --systems gives checked against the programs, the cold start if
asked, and one worker process a GPU (NCCL over TCP on localhost, gloo for the ranks' agreement)
running the sweep. The objects handed to the spawned workers live here (picklable by name)."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket

import click

from moe_ar_tools import provenance
from moe_ar_tools.bench.config import DTYPE_BYTES, Config, set_required_env
from moe_ar_tools.bench.multi_gpu.config import SYSTEM_CHOICES
from moe_ar_tools.bench.records import default_out_path


def free_port() -> int:
    """A TCP port on localhost free now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cfg: Config) -> None:
    """One process per GPU: NCCL group over TCP on localhost, a gloo group for CPU agreement."""
    set_required_env()
    import torch
    import torch.distributed as dist
    from moe_ar_tools.bench.multi_gpu.sweep import Bench
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


def check(cfg: Config) -> None:
    """click.BadParameter for a system that is neither one of SYSTEM_CHOICES nor a program's name."""
    import dispatch
    for s in cfg.systems:
        if s not in SYSTEM_CHOICES and s not in dispatch.programs():
            raise click.BadParameter(f"system {s!r}: not one of {', '.join(SYSTEM_CHOICES)} nor a program name")


def _cold_start(cfg: Config) -> None:
    """Compile one program at first use, then load it from the warm cache (cold_start.py); without
    the sweep, the result goes to a file of its own."""
    from dispatch import registry, table_sets
    from moe_ar_tools.bench.multi_gpu.cold_start import measure_cold_start
    selection = table_sets.for_workspace(cfg.dtype, cfg.world, cfg.shapes[0].hidden, DTYPE_BYTES[cfg.dtype], 0)
    name = cfg.cold_start_program or registry.program_for(
        registry.select_family(cfg.dtype, cfg.world, "plain", 1, False, 1024, bounds=selection.limits("plain")),
        cfg.dtype, cfg.world, "plain")
    click.echo(f"cold start: {name} ...")
    cfg.cold_start = measure_cold_start(name)
    click.echo(json.dumps(cfg.cold_start, indent=1))
    if cfg.sweep:
        return
    if cfg.out:
        path = pathlib.Path(cfg.out)
    else:
        path = default_out_path(cfg.machine or os.environ.get("MOE_AR_MACHINE") or socket.gethostname(),
                                datetime.datetime.now())
        path = path.with_name(path.stem + "-cold-start.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance.stamp(), "cold_start": cfg.cold_start}, indent=1))
    click.echo(f"wrote {path}")


def run(cfg: Config) -> None:
    """The cold start if asked, then the sweep on cfg.world GPUs of this machine, one process each."""
    if cfg.measure_cold_start:
        _cold_start(cfg)
    if not cfg.sweep:
        return
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < cfg.world:
        raise click.ClickException(f"--world {cfg.world} needs {cfg.world} GPUs, this machine has "
                                   f"{torch.cuda.device_count()}")
    cfg.init_method = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_worker, args=(cfg,), nprocs=cfg.world, join=True)
