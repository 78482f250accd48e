"""The command (moe-ar-bench, python -m moe_ar_tools.bench): one set of options for every world size,
parsed into one Config, then the world size's plugin runs it: world_one at --world 1, multi_gpu at 2
and up. An option of one world size's plugin given to another is refused; --dry-run prints the plan."""
from __future__ import annotations

import json
import time

import click
from click.core import ParameterSource

from moe_ar_tools.bench.config import (COMPILE_MODES, DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPE_BYTES, L2_MODES, make_config,
                                       set_required_env)
from moe_ar_tools.bench.multi_gpu import config as multi_config
from moe_ar_tools.bench.world_one import config as one_config

# the options only one kind of world size takes (the command's parameter names)
WORLD_ONE_OPTIONS = ("compile_modes", "static_compile_shapes", "l2", "flashinfer_dir", "programs")
MULTI_GPU_OPTIONS = ("machine", "timeout_s", "measure_cold_start", "cold_start_program", "sweep", "pdl",
                     "vec_per_thread")


def _refuse_foreign(ctx: click.Context, world: int) -> None:
    """UsageError for an option of the other kind of world size given on the command line."""
    foreign = MULTI_GPU_OPTIONS if world == 1 else WORLD_ONE_OPTIONS
    for param in ctx.command.params:
        if param.name in foreign and ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE:
            raise click.UsageError(f"{param.opts[0]} is for --world {'2 and up' if world == 1 else '1'}, "
                                   f"not --world {world}", ctx)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--world", type=click.IntRange(1), default=2,
              help="world size: GPUs of this machine, one process each; 1: one GPU, no exchange, against the "
                   "world-size-1 baselines (Triton, the torch chains, FlashInfer)")
@click.option("--shapes", default=DEFAULT_SHAPES, help="HIDDEN:TOP_K[:shared], comma separated (world 1: the "
                                                      "first is also the floor's shape)")
@click.option("--tokens", default=DEFAULT_TOKENS, help="comma separated, or a power-of-two range like 1-16384")
@click.option("--profiles", default=None,
              help=f"output profiles, comma separated [default: world 2+ {multi_config.VOCABULARY.default_profiles}; "
                   f"world 1 all of {', '.join(one_config.PROFILES)}]; world 2+: "
                   f"{', '.join(multi_config.VOCABULARY.profiles)}")
@click.option("--dtype", type=click.Choice(sorted(DTYPE_BYTES)), default="bf16")
@click.option("--systems", default=None,
              help=f"comma separated [default: all]; world 2+: of {', '.join(multi_config.SYSTEM_CHOICES)} "
                   f"(every generated program) or program names; world 1: of {', '.join(one_config.SYSTEMS)}")
@click.option("--reps", default=50, help="timed replays per system and point (docs/measurement.md: at least 50)")
@click.option("--calls", default=10, help="back-to-back calls captured in one CUDA graph")
@click.option("--warmup", default=3, help="eager calls before capture")
@click.option("--out", default=None,
              help="world 2+: the JSON [default: bench_results/<machine>-<date>.json], the PNG plot and the "
                   ".summary.txt beside it; world 1: the output folder [default: bench_results/world_size_1/run-<date>]")
@click.option("--seed", default=1234)
@click.option("--bw-gib", default=2.0, help="GiB per copy in the bandwidth measurement")
@click.option("--budget-s", "--time-budget-s", "budget_s", type=float, default=None,
              help=f"seconds from launch: world 2+ starts no token count after it (the JSON then says truncated) "
                   f"[default {multi_config.VOCABULARY.budget_s:.0f}]; world 1 starts no point that would end past "
                   f"it, 0 none (the rest skipped) [default {one_config.VOCABULARY.budget_s:.0f}]")
@click.option("--dry-run", is_flag=True, help="print what would be measured (and compiled), then stop (no GPU)")
# world size 2 and up
@click.option("--machine", default=None, help="[world 2+] machine name for the results [default: $MOE_AR_MACHINE "
                                              "or <W>x<GPU>-<hostname>]")
@click.option("--timeout-s", default=30.0, help="[world 2+] the workspaces' peer-wait deadline")
@click.option("--cold-start/--no-cold-start", "measure_cold_start", default=False,
              help="[world 2+] also measure compiling one program at first use and loading it from the warm cache")
@click.option("--cold-start-program", default=None,
              help="[world 2+] [default: the auto choice at 1 token, profile plain]")
@click.option("--sweep/--no-sweep", default=True, help="[world 2+] run the latency sweep")
@click.option("--pdl/--no-pdl", default=False, help="[world 2+] launch the fused calls with programmatic dependent "
                                                    "launch (world 1 times both: ours, ours_pdl)")
@click.option("--vec-per-thread", type=click.IntRange(1, 4), default=None,
              help="[world 2+] the workspaces' row split: 16-byte vectors per thread [default: the runtime's]")
# world size 1
@click.option("--compile-modes", default=",".join(COMPILE_MODES),
              help="[world 1] torch.compile modes: dynamic (one compile for every T), static (one per T)")
@click.option("--static-compile-shapes", default="7168:8:shared",
              help="[world 1] shapes compiled per T too (compiles are slow: the target shape); empty for none")
@click.option("--l2", default=",".join(L2_MODES),
              help="[world 1] L2 modes: cold (inputs rotated through more than 3x the L2), warm (one input set)")
@click.option("--flashinfer-dir", default=None, help="[world 1] FlashInfer's norm kernels as fetch_flashinfer.sh "
                                                     "prepares them [default: .baselines/flashinfer]")
@click.option("--programs/--no-programs", default=True,
              help="[world 1] also force every world-size-1 program where a cell has more than one")
@click.pass_context
def main(ctx, world, dry_run, **options):
    """Benchmark the fused MoE finalize (+ all-reduce) + residual + RMSNorm (+ quantization) programs on
    this machine (docs/measurement.md): at world size 2 and up against NCCL and torch symmetric memory,
    at world size 1 against a fused Triton kernel, the Triton chain, the eager and compiled torch chains
    and FlashInfer's norm kernels."""
    started = time.time()
    set_required_env()  # never NVLink multicast: before any CUDA library starts
    _refuse_foreign(ctx, world)
    plugin = one_config if world == 1 else multi_config
    try:
        cfg = make_config(plugin.VOCABULARY, world=world, started=started, **options)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if cfg.reps < 50:
        click.echo(f"note: --reps {cfg.reps} is below the 50 of docs/measurement.md", err=True)
    if world == 1:
        if dry_run:
            click.echo(json.dumps(one_config.plan(cfg), indent=1))
            return
        import torch
        if not torch.cuda.is_available():
            raise click.ClickException("no CUDA GPU: --world 1 runs on one GPU (--dry-run shows the plan)")
        from moe_ar_tools.bench.world_one.runner import Runner
        Runner(cfg).run()
        return
    from moe_ar_tools.bench.multi_gpu import launch
    launch.check(cfg)
    if dry_run:
        click.echo(json.dumps(multi_config.plan(cfg), indent=1))
        return
    launch.run(cfg)
