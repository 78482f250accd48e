"""The command: moe-ar-bench-one (python -m moe_ar_tools.bench_one); --dry-run prints the plan."""
from __future__ import annotations

import json
import time

import click

from moe_ar_tools.bench.config import DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPE_BYTES
from moe_ar_tools.bench_one.config import COMPILE_MODES, DEFAULT_BUDGET_S, PROFILES, SYSTEMS, make_config, plan
from moe_ar_tools.bench_one.runner import Runner


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--shapes", default=DEFAULT_SHAPES, help="HIDDEN:TOP_K[:shared], comma separated (the first is "
                                                      "also the floor's shape)")
@click.option("--tokens", default=DEFAULT_TOKENS, help="comma separated, or a power-of-two range like 1-16384")
@click.option("--profiles", default=",".join(PROFILES), help="output profiles, comma separated")
@click.option("--systems", default=",".join(SYSTEMS), help="systems, comma separated")
@click.option("--compile-modes", default=",".join(COMPILE_MODES),
              help="torch.compile modes: dynamic (one compile for every T), static (one per T)")
@click.option("--static-compile-shapes", default="7168:8:shared",
              help="shapes compiled per T too (compiles are slow: the target shape); empty for none")
@click.option("--l2", default="cold,warm", help="L2 modes: cold (inputs rotated through more than 3x the L2), "
                                                "warm (one input set)")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bf16")
@click.option("--reps", default=50, help="timed replays per system and point (at least 50)")
@click.option("--calls", default=10, help="back-to-back calls captured in one CUDA graph")
@click.option("--warmup", default=3, help="eager calls before capture")
@click.option("--budget-s", default=DEFAULT_BUDGET_S, help="no point starts that would end past this many "
                                                           "seconds from launch (0: no budget); the rest is skipped")
@click.option("--out", default=None, help="output folder [default: bench_results/world_size_1/run-<date>]")
@click.option("--seed", default=1234)
@click.option("--bw-gib", default=2.0, help="GiB per copy in the bandwidth measurement")
@click.option("--flashinfer-dir", default=None, help="FlashInfer's norm kernels as fetch_flashinfer.sh prepares "
                                                     "them [default: .baselines/flashinfer]")
@click.option("--programs/--no-programs", default=True,
              help="also force every world-size-1 program where a cell has more than one")
@click.option("--dry-run", is_flag=True, help="print what would be measured and compiled, then stop (no GPU)")
def main(dry_run, **options):
    """Benchmark the world-size-1 op against the eager and compiled torch chains and FlashInfer's norm
    kernels on one GPU."""
    started = time.time()
    try:
        cfg = make_config(started=started, **options)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if cfg.reps < 50:
        click.echo(f"note: --reps {cfg.reps} is below the 50 of docs/measurement.md", err=True)
    if dry_run:
        click.echo(json.dumps(plan(cfg), indent=1))
        return
    import torch
    if not torch.cuda.is_available():
        raise click.ClickException("no CUDA GPU: moe-ar-bench-one runs on one GPU (--dry-run shows the plan)")
    Runner(cfg).run()
