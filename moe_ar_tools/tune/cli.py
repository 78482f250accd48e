"""python -m moe_ar_tools.tune (also `gen-programs tune`): measure this machine's selection tables.

    python -m moe_ar_tools.tune --out tables.json --budget-s 1800
    MOE_AR_TABLES=tables.json python my_server.py        # the runtime takes it as a user's own set

World sizes: 1 on one GPU (dispatch.LocalWorkspace), and every generated world size up to the GPU
count with real ranks, one process a GPU, started here. A world size larger than the GPU count is
refused: emulated ranks share one GPU, so their times describe no machine. The stamp is taken once,
on the GPUs of the largest world size, with the peer bandwidth measured between GPU 0 and GPU 1.
"""
from __future__ import annotations

import datetime
import pathlib
import time

import click

from generator import spec

from ..bench.config import DEFAULT_SHAPES, DEFAULT_TOKENS, parse_list, parse_shapes, parse_tokens, set_required_env
from ..bench.multi_gpu.launch import free_port
from ..bench.roofline import measure_bandwidth
from .. import stamp as stamps
from . import loop, output, units

DEFAULT_OUT = "moe_ar_tables.json"
EMULATED = ("emulated ranks (several on one GPU, as EmulatedWorld runs them) share that GPU's multiprocessors "
            "and memory bandwidth and exchange nothing over NVLink, so their times describe no machine")


def world_sizes_to_measure(asked, gpus: int, generated, has_local: bool) -> list[int]:
    """The world sizes a tune measures: those asked for (default: every generated one this machine can
    run); ValueError naming `world_sizes` for one it cannot measure, and why."""
    runnable = [w for w in generated if w <= gpus and (w > 1 or has_local)]
    if asked is None:
        if not runnable:
            raise ValueError(f"world_sizes: this machine has {gpus} GPU(s): no generated world size "
                             f"({', '.join(map(str, generated))}) runs on real ranks here")
        return runnable
    for w in asked:
        if w not in generated:
            raise ValueError(f"world_sizes: no programs are generated for world size {w} (generated: "
                             f"{', '.join(map(str, generated))})")
        if w > gpus:
            raise ValueError(f"world_sizes: world size {w} needs {w} GPUs, this machine has {gpus}; tune measures "
                             f"real ranks only, one process a GPU: {EMULATED}")
        if w == 1 and not has_local:
            raise ValueError("world_sizes: world size 1 needs dispatch.LocalWorkspace (a world of one), which this "
                             "runtime does not have")
    return sorted(set(asked))


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what}: {text!r} is not a comma-separated list of ints") from None


def _peer_bandwidth(gpus: int) -> float | None:
    if gpus < 2:
        return None
    return measure_bandwidth(2, 1.0)["nvlink_GBps"]


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--out", type=click.Path(dir_okay=False, path_type=pathlib.Path), default=DEFAULT_OUT,
              help="the output file; an earlier run's is resumed (same machine and programs)")
@click.option("--budget-s", type=click.FloatRange(min=0), default=None,
              help="start no unit that would end past this many seconds [default: no bound]")
@click.option("--world-sizes", default=None, help="comma separated [default: every generated one up to the GPU count]")
@click.option("--dtype", type=click.Choice(spec.DTYPES), default="bf16", help="the other dtype borrows these tables")
@click.option("--profiles", default=",".join(spec.OUTPUT_PROFILES), help="output profiles, comma separated")
@click.option("--shapes", default=DEFAULT_SHAPES,
              help="HIDDEN:TOP_K[:shared], comma separated; two hidden sizes place the byte boundaries")
@click.option("--tokens", default=DEFAULT_TOKENS, help="comma separated, or a power-of-two range like 1-16384")
@click.option("--reps", default=50, help="timed replays a program and unit (docs/measurement.md: at least 50)")
@click.option("--calls", default=10, help="back-to-back calls in one CUDA graph")
@click.option("--warmup", default=3, help="eager calls before capture")
@click.option("--seed", default=1234)
@click.option("--name", default=None, help="the set's name [default: tuned <GPU> x<count> <date>]")
def main(out, budget_s, world_sizes, dtype, profiles, shapes, tokens, reps, calls, warmup, seed, name):
    """Measure every base program of every cell this machine can run and write the fitted table set."""
    started = time.time()
    try:
        shapes, tokens = parse_shapes(shapes), parse_tokens(tokens)
        profiles = parse_list(profiles, spec.OUTPUT_PROFILES, "profile")
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    import torch
    import dispatch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise click.ClickException("tune measures on GPUs: none is visible here")
    generated = sorted({dispatch.program_info(p)["world_size"] for p in dispatch.programs()})
    try:
        sizes = world_sizes_to_measure(None if world_sizes is None else _ints(world_sizes, "world_sizes"), gpus,
                                       generated, hasattr(dispatch, "LocalWorkspace"))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    set_required_env()
    stamp = stamps.collect(list(range(max(sizes))), peer_bandwidth_GBps=_peer_bandwidth(max(sizes)))
    name = name or f"tuned {stamp['gpu']['product']} x{stamp['gpu']['count']} {datetime.date.today().isoformat()}"
    earlier = output.load(out) if out.exists() else None
    if earlier is not None:
        why = output.resume_refused(earlier, stamp)
        if why is not None:
            raise click.ClickException(f"{out} holds an earlier tune that cannot be resumed here: {why}; give another "
                                       f"--out or remove it")
        name = earlier["name"]
        click.echo(f"resuming {out}: {len(earlier['done'])} units done before")
    config = {"world_sizes": sizes, "dtype": dtype, "profiles": profiles, "shapes": [s.label for s in shapes],
              "tokens": tokens, "reps": reps, "calls": calls, "warmup": warmup, "seed": seed}
    deadline = started + (budget_s if budget_s is not None else float("inf"))
    run = dict(out=str(out), name=name, stamp=stamp, config=config, deadline=deadline, dtype=dtype,
               max_tokens=max(tokens), reps=reps, calls=calls, warmup=warmup, seed=seed)
    click.echo(f"tune: {stamp['gpu']['product']} x{gpus}, world sizes {', '.join(map(str, sizes))}; writing {out}")
    for world_size in sizes:
        todo = units.plan([world_size], dtype, shapes, tokens, profiles)
        if world_size == 1:
            _local(todo, run)
        else:
            import torch.multiprocessing as mp
            mp.spawn(_rank_main, args=(world_size, todo, dict(run, init_method=f"tcp://127.0.0.1:{free_port()}")),
                     nprocs=world_size, join=True)
    doc = output.load(out)
    for row in (doc["set"] or {}).get("boundaries", []):  # the fit's error per cell: how close auto comes to the best
        click.echo(f"  {row['dtype']} ws{row['world_size']} {row['profile']}: {row['source']}")
    state = "complete" if doc["complete"] else "stopped by the time budget" if doc["truncated"] else "incomplete"
    click.echo(f"{out}: {len(doc['done'])} units, {len(doc['set']['boundaries']) if doc['set'] else 0} cells fitted, "
               f"{state}. Use it with MOE_AR_TABLES={out} or Workspace(..., tables=...); commit it as a table "
               f"set with generator/table_sets.py COMMITTED_SETS")


def _measure_args(run: dict) -> dict:
    return {key: run[key] for key in ("dtype", "max_tokens", "reps", "calls", "warmup", "seed")}


def _local(todo: list, run: dict) -> None:
    """A world of one, in this process."""
    from .gpu import RankMeasurer
    measurer = RankMeasurer(world_size=1, rank=0, **_measure_args(run))
    try:
        loop.run(todo, lambda unit: [measurer.measure(unit)], pathlib.Path(run["out"]), name=run["name"],
                 stamp=run["stamp"], config=run["config"], deadline=run["deadline"], clock=time.time,
                 progress=loop.Progress())
    finally:
        measurer.close()


def _rank_main(rank: int, world_size: int, todo: list, run: dict) -> None:
    """One process a GPU: rank 0 runs the loop and hands each unit to every rank over gloo."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from .gpu import RankMeasurer
    set_required_env()
    torch.cuda.set_device(rank)
    timeout = dt.timedelta(seconds=600)
    dist.init_process_group("nccl", init_method=run["init_method"], rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank), timeout=timeout)
    measurer = None
    try:
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        measurer = RankMeasurer(world_size=world_size, rank=rank, group=dist.group.WORLD, gloo=gloo,
                                **_measure_args(run))

        def handed(unit):
            box = [unit]
            dist.broadcast_object_list(box, src=0, group=gloo)
            return box[0]

        if rank == 0:
            try:
                loop.run(todo, lambda unit: measurer.gather(measurer.measure(handed(unit))), pathlib.Path(run["out"]),
                         name=run["name"], stamp=run["stamp"], config=run["config"], deadline=run["deadline"],
                         clock=time.time, progress=loop.Progress())
            finally:
                handed(None)  # every other rank stops
        else:
            while (unit := handed(None)) is not None:
                measurer.gather(measurer.measure(unit))
        measurer.close()
    finally:
        dist.destroy_process_group()

