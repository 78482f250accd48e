"""gen-programs: regenerate, check, list, show, diff and compile the programs.

    gen-programs                 regenerate generated/
    gen-programs --check         fail (exit 1, with the diff) when generated/ is stale
    gen-programs list [filters]  programs: name, family, profile, protocol class, file
    gen-programs tables [--width N]
                                 how program names spell families and profiles; every family
                                 as a grid, holes and fallbacks shown; the selection boundaries
                                 (in 120 columns, or N; 0: one line a row)
    gen-programs diff REV        table cells changed since git revision REV (exit 0 none, 1 some,
                                 2 generated/ stale or an error)
    gen-programs compile [filters] [--arch A ...] [--jobs N]
                                 NVRTC-compile programs, print registers/spills
    gen-programs tune [options]  measure this machine's table set on its GPUs (python -m
                                 moe_ar_tools.tune in a subprocess: the generator never touches a GPU)

In a source checkout (or an editable install) these read and write the checkout's generated/.
Installed from a wheel, they read the installed tree (package data, generator/locations.py);
regenerating then needs --out DIR, and diff a repository. Run inside a checkout other than the
one they read, regenerating, --check and diff refuse (they would answer for the other tree).
"""
from __future__ import annotations

import os
import pathlib
import sys
import textwrap
import time

import click

from moe_ar_common import manifest_reader

from . import locations, spec


def _no_sources() -> click.ClickException:
    return click.ClickException(
        "found neither a source checkout around this generator nor the installed package data "
        f"({locations.DATA_PACKAGE}); reinstall the package, or run gen-programs in a clone of the repository")


def _installed_only(what: str, alternative: str = "") -> click.ClickException:
    """A command that needs a repository, run from an installed wheel: say where it can run instead."""
    here = locations.enclosing_checkout(pathlib.Path.cwd())
    hint = (f"; the checkout at {here} is not the one this gen-programs runs from: run `pip install -e .` "
            f"there, or `python -m generator.cli` in it" if here else "")
    return click.ClickException(
        f"{what} needs a repository{' or ' + alternative if alternative else ''}: this gen-programs is installed "
        f"({pathlib.Path(__file__).resolve().parent}), and its generated tree is read-only package data; "
        f"run it in a clone of the repository{hint}")


def _refuse_another_checkout(root: pathlib.Path, what: str) -> None:
    """Regenerating, --check and diff work on the tree at root; run inside another checkout of this
    project they would answer for a tree the user does not stand in (and say "up to date"): refuse."""
    here = locations.enclosing_checkout(pathlib.Path.cwd().resolve())
    if here is None or here == root.resolve():
        return
    runs_from = "the checkout at" if locations.checkout_root() is not None else "the installed package data at"
    raise click.ClickException(
        f"{what} would work on {runs_from} {root}, not on the checkout you are in ({here}). To work on {here}, "
        f"run `pip install -e .` there (or `python -m generator.cli` in it); to work on the other, run "
        f"gen-programs outside {here}")


def _generated(ctx: click.Context) -> pathlib.Path:
    """--out, else the checkout's generated/, else the installed wheel's copy."""
    if ctx.obj["out"] is not None:
        return ctx.obj["out"]
    root = locations.source_root()
    if root is None:
        raise _no_sources()
    return root / "generated"


def _manifest(generated: pathlib.Path) -> dict:
    try:
        return manifest_reader.load_manifest(generated)
    except manifest_reader.ManifestError as e:
        raise click.ClickException(str(e)) from None


def _filters(fn):
    fn = click.option("--profile", "profiles", multiple=True, type=click.Choice(spec.OUTPUT_PROFILES),
                      help=f"Output profile: the call's quant= value, {spec.PLAIN} for none (repeatable).")(fn)
    fn = click.option("--world-size", "world_sizes", multiple=True,
                      type=click.Choice([str(w) for w in spec.WORLD_SIZES]), help="World size (repeatable).")(fn)
    fn = click.option("--dtype", "dtypes", multiple=True, type=click.Choice(spec.DTYPES),
                      help="Input dtype (repeatable).")(fn)
    fn = click.option("--family", "families", multiple=True, type=click.Choice(spec.FAMILIES),
                      help="Program family (repeatable).")(fn)
    return fn


def _select(manifest: dict, families, dtypes, world_sizes, profiles) -> list[dict]:
    def keep(values, value):
        return not values or value in values
    return [entry for entry in manifest["programs"]
            if keep(families, entry["family"]) and keep(dtypes, entry["dtype"])
            and keep(world_sizes, str(entry["world_size"])) and keep(profiles, entry["profile"])]


def _none_selected(manifest: dict, families, dtypes, world_sizes, profiles) -> str:
    """Why the filters select no program: the holes they match, each with its reason and the family
    whose program runs there instead; the world sizes they name outside a family's own."""
    def keep(values, value):
        return not values or value in values
    holes = [h for h in manifest["holes"]
             if keep(families, h["family"]) and keep(dtypes, h["dtype"])
             and keep(world_sizes, str(h["world_size"])) and keep(profiles, h["profile"])]
    no_peers = manifest["selection"]["no_peers"]
    outside = []
    for family in manifest["axes"]["families"]:
        missing = [w for w in world_sizes if int(w) not in family["world_sizes"]] if families else []
        if family["name"] not in families or not missing:
            continue
        own = "/".join(str(w) for w in family["world_sizes"])
        instead = (f"with no peers every exchange rung runs {no_peers['family']} there"
                   if missing == [str(no_peers["world_size"])] else "no call selects it with peers")
        outside.append(f"{family['name']} has no program at world size{'s' if len(missing) > 1 else ''} "
                       f"{'/'.join(missing)}: its world size{'s are' if len(family['world_sizes']) > 1 else ' is'} "
                       f"{own}; {instead}")
    if not holes:
        return "\n".join(outside) or "no program matches the filters"
    groups: dict[tuple, list[dict]] = {}
    for h in holes:
        groups.setdefault((h["family"], h["reason"], h["fallback_family"]), []).append(h)
    lines = []
    for (family, reason, fallback), cells in groups.items():
        where = []  # the axes the filters named, and those on which these holes are a part of the cells asked for
        for axis, label, given, every in (("dtype", "dtype", dtypes, spec.DTYPES),
                                          ("world_size", "world size", world_sizes, spec.WORLD_SIZES),
                                          ("profile", "profile", profiles, spec.OUTPUT_PROFILES)):
            order = [str(v) for v in every]
            values = sorted({str(c[axis]) for c in cells}, key=order.index)
            if given or set(values) != (set(given) or set(order)):
                where.append(f"{label}{'s' if len(values) > 1 else ''} {'/'.join(values)}")
        at = f" at {', '.join(where)}" if where else ""
        instead = f"calls there run {fallback}"
        lines.append(f"{family} has no program{at} (hole: {reason}); {instead}")
    return "\n".join(lines + outside)


def _print_rows(rows: list[tuple], header: tuple, width: int | None = None) -> None:
    """Rows under a header, columns padded. Where they would pass `width` characters, the columns after
    the first are cut into blocks of about equal size, printed one under the other, each led by the first."""
    rows = [tuple(str(cell) for cell in header)] + [tuple(str(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    columns = list(range(1, len(header)))
    blocks = [columns]
    if width and columns and sum(widths) + 2 * len(columns) > width:
        fitting = max(1, (width - widths[0]) // (2 + max(widths[1:])))
        per_block = -(-len(columns) // -(-len(columns) // fitting))  # as even as the fewest blocks allow
        blocks = [columns[i:i + per_block] for i in range(0, len(columns), per_block)]
    for block in blocks:
        for row in rows:
            click.echo("  ".join(row[i].ljust(widths[i]) for i in [0, *block]).rstrip())


def _echo_wrapped(text: str, width: int | None) -> None:
    """A line of prose, wrapped at `width` (None: not), the wrapped lines indented under its start."""
    if not width:
        click.echo(text)
        return
    lead = text[:len(text) - len(text.lstrip())]
    click.echo("\n".join(textwrap.wrap(text.strip(), width, initial_indent=lead, subsequent_indent=lead + "  ",
                                       break_long_words=False, break_on_hyphens=False)) or text)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--check", is_flag=True,
              help="Render into a temporary folder and compare with generated/; exit 1 with the diff when stale.")
@click.option("--out", type=click.Path(file_okay=False, path_type=pathlib.Path), default=None,
              help="Write here instead of generated/ (an empty folder, or one written by gen-programs).")
@click.pass_context
def main(ctx: click.Context, check: bool, out: pathlib.Path | None) -> None:
    """Generate the MoE finalize + all-reduce programs (no arguments: regenerate generated/)."""
    ctx.ensure_object(dict)
    ctx.obj["out"] = out
    if ctx.invoked_subcommand is not None:
        if check:
            raise click.UsageError("--check takes no subcommand")
        return
    from . import render

    # A checkout regenerates its own generated/; an installed wheel renders from its package data,
    # into --out only (--check compares with the installed tree).
    root = locations.checkout_root()
    if root is None:
        root = locations.installed_root()
        if root is None:
            raise _no_sources()
        if out is None and not check:
            raise _installed_only("regenerating", "--out DIR (render into DIR)")
    if out is None:
        _refuse_another_checkout(root, "--check" if check else "regenerating")
    start = time.perf_counter()
    result = render.render_all(root)
    dest = out or root / "generated"
    n_programs, n_holes = len(result.enumeration.programs), len(result.enumeration.holes)
    if check:
        diffs = render.check_tree(result.outputs, dest)
        if diffs:
            for d in diffs:
                click.echo(d, nl=False)
            click.echo(f"{dest.name}/ is stale: {len(diffs)} file(s) differ; {manifest_reader.REGENERATE}", err=True)
            ctx.exit(1)
        click.echo(f"{dest.name}/ is up to date: {n_programs} programs, {n_holes} holes, "
                   f"{len(result.outputs)} files ({time.perf_counter() - start:.2f} s)")
        return
    try:
        report = render.write_tree(result.outputs, dest)
    except render.GenerateError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{n_programs} programs, {n_holes} holes: {len(report.written)} files written, "
               f"{len(report.unchanged)} unchanged, {len(report.removed)} removed "
               f"({time.perf_counter() - start:.2f} s)")


@main.command("list")
@_filters
@click.pass_context
def list_programs(ctx, families, dtypes, world_sizes, profiles):
    """List programs: name, family, profile, protocol class, file (from generated/manifest.json)."""
    manifest = _manifest(_generated(ctx))
    programs = _select(manifest, families, dtypes, world_sizes, profiles)
    if not programs:
        raise click.ClickException(_none_selected(manifest, families, dtypes, world_sizes, profiles))
    _print_rows([(entry["name"], entry["family"], entry["profile"], entry["protocol_class"],
                  f"generated/{entry['file']}") for entry in programs],
                ("name", "family", "profile", "protocol class", "file"))


@main.command()
@click.option("--width", type=click.IntRange(min=0), default=120, show_default=True,
              help="Fit the output in this many columns (grids too wide are cut into blocks of profile "
                   "columns, prose is wrapped); 0: one line a row, however wide.")
@click.pass_context
def tables(ctx, width):
    """How names spell families and profiles; every family as a grid (rows dtype x world size,
    columns output profiles); the selection boundaries."""
    width = width or None
    manifest = _manifest(_generated(ctx))
    axes = manifest["axes"]
    families, profiles = axes["families"], axes["output_profiles"]
    profile_names = [profile["name"] for profile in profiles]
    click.echo("program names: moe_ar_<family>_<dtype>_ws<world size>_<output profile>")
    _print_rows([("  " + family["name"], family["title"]) for family in families], ("  family", "what it is"), width)
    _print_rows([("  " + profile["name"], "None" if profile["quant"] is None else profile["quant"])
                 for profile in profiles], ("  output profile", "quant="), width)
    click.echo()
    programs = {_cell(entry): entry for entry in manifest["programs"]}
    holes = {_cell(hole): hole for hole in manifest["holes"]}
    no_peers = manifest["selection"]["no_peers"]
    spaces: dict[tuple, list[dict]] = {}  # world size 1's families, then the exchange families
    for family in families:
        spaces.setdefault(tuple(family["world_sizes"]), []).append(family)
    for world_sizes, members in spaces.items():
        names = ", ".join(family["name"] for family in members)
        where = f"world size{'s' if len(world_sizes) > 1 else ''} {', '.join(map(str, world_sizes))}"
        if list(world_sizes) == [no_peers["world_size"]]:
            what = f"nothing to exchange ({names}); every exchange rung of the ladder runs {no_peers['family']} here"
        else:
            what = f"the exchange families ({names})"
        _echo_wrapped(f"== {where}: {what}", width)
        click.echo()
        for family in members:
            _print_family(family, world_sizes, axes["dtypes"], profile_names, programs, holes, width)
    _echo_wrapped(f"{len(programs)} programs, {len(holes)} holes (a hole: a cell of a family's world sizes without "
                  f"a program)", width)
    click.echo()
    selection = manifest["selection"]
    # each space's boundaries: those of the rungs whose family has its world sizes
    world_sizes_of_rung = {f["regime"]: tuple(f["world_sizes"]) for f in families if not f["shared_prefetch"]}
    fields = {world_sizes: [field for regime, field in selection["ladder"]
                            if field is not None and world_sizes_of_rung[regime] == world_sizes]
              for world_sizes in spaces}
    _echo_wrapped(f"selection: {selection['rule']}", width)
    _echo_wrapped("  per device the runtime takes the first set whose key matches (exact product, then the same "
                  "compute capability and interconnect), then the written model; boundaries in tokens, or in bytes "
                  "per rank (KiB, MiB: T x hidden x element bytes); all: no bound", width)
    for table_set in selection["sets"]:
        _print_set(table_set, axes, profile_names, fields, selection["no_peers"], width)


def _print_family(family: dict, world_sizes, dtypes, profile_names, programs: dict, holes: dict,
                  width: int | None) -> None:
    """One family as a grid over its world sizes (rows dtype x world size, columns output profiles),
    holes marked with their reason and fallback."""
    name = family["name"]
    _echo_wrapped(f"{name}  (base {family['base']}, protocol {family['protocol']})", width)
    _echo_wrapped(f"  {family['meaning']}", width)
    rows, reasons = [], {}
    for dtype in dtypes:
        for world_size in world_sizes:
            row = [f"  {dtype} ws{world_size}"]
            for profile in profile_names:
                key = (name, dtype, world_size, profile)
                if key in programs:
                    row.append(programs[key]["name"])
                else:
                    hole = holes[key]
                    mark = reasons.setdefault(hole["reason"], f"[{len(reasons) + 1}]")
                    row.append(f"-- hole{mark} -> {hole['fallback_family']}")
            rows.append(row)
    _print_rows(rows, ("  ", *profile_names), width)
    for reason, mark in reasons.items():
        _echo_wrapped(f"  hole{mark}: {reason}", width)
    click.echo()


def _print_set(table_set: dict, axes: dict, profile_names: list, fields: dict, no_peers: dict,
               width: int | None = None) -> None:
    """One table set: its key, its measurement files, its boundaries as a grid per space ({world sizes:
    the boundary fields of the rungs that run there})."""
    from .tuning import shown_limit

    match = table_set["match"]
    click.echo()
    _echo_wrapped(f"set {table_set['name']} ({table_set['table']}): {table_set['title']}", width)
    if match:
        _echo_wrapped(f"  for product {match['product']!r}, compute capability {match['capability']}, interconnect "
                      f"{match['interconnect']}", width)
    for source in table_set["sources"]:
        _echo_wrapped(f"  measured in {source['file']}", width)
    bounds = {(row["dtype"], row["world_size"], row["profile"]): row for row in table_set["boundaries"]}
    for world_sizes, space_fields in fields.items():
        where = f"world size{'s' if len(world_sizes) > 1 else ''} {', '.join(map(str, world_sizes))}"
        above = (f" (above: {no_peers['family']} again, no peers)" if list(world_sizes) == [no_peers["world_size"]]
                 else "")
        _echo_wrapped(f"  {where}: {' / '.join(space_fields)}{above}", width)
        rows = []
        for dtype in axes["dtypes"]:
            for world_size in world_sizes:
                row = [f"  {dtype} ws{world_size}"]
                for profile in profile_names:
                    cell = bounds[(dtype, world_size, profile)]
                    mark = "" if cell["source"].startswith("measured") else " (model)"
                    row.append(" / ".join(shown_limit(cell["limits"][field], cell["key"]) for field in space_fields)
                               + mark)
                rows.append(row)
        _print_rows(rows, ("  ", *profile_names), width)
        for (dtype, world_size, profile), cell in bounds.items():  # the hidden sizes with boundaries of their own
            for hidden, own in cell.get("by_hidden", {}).items() if world_size in world_sizes else ():
                _echo_wrapped(f"  {dtype} ws{world_size} {profile} at hidden {hidden}: "
                              + " / ".join(shown_limit(own["limits"][field], cell["key"]) for field in space_fields)
                              + " (measured " + " to ".join(shown_limit(v, cell["key"]) for v in own["measured"])
                              + ")", width)
    if any(not cell["source"].startswith("measured") for cell in bounds.values()):
        _echo_wrapped("  (model): no measurement covers the cell; the written model in generator/tuning.py decides",
                      width)


def _cell(entry: dict) -> tuple:
    return (entry["family"], entry["dtype"], entry["world_size"], entry["profile"])


@main.command()
@click.argument("rev")
@click.pass_context
def diff(ctx, rev):
    """Cells changed between the manifest committed at REV and generated/ now: programs that
    appeared, vanished or were renamed, programs whose code changed (one line per cause: the kernel
    headers whose code changed, the program file), boundaries that moved; then a summary line.

    Exit status: 0 no changes, 1 changes, 2 generated/ stale (its inputs changed since the last
    `gen-programs`, so the diff would miss them) or an error (REV unknown, no repository)."""
    from . import diffing, render

    try:
        root = locations.checkout_root()
        if root is None:
            raise _installed_only("diff (it reads the git history)")
        _refuse_another_checkout(root, "diff")
        generated = _generated(ctx)
        try:
            new = diffing.manifest_in(generated)
            old = diffing.manifest_at(rev, root)
        except (manifest_reader.ManifestError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        if new["_generated"]["inputs_sha256"] != render.inputs_sha256(root):
            raise click.ClickException(f"{generated.name}/ is stale: its inputs changed since it was rendered, so "
                                       f"a diff would miss those changes; run `gen-programs`, then the diff again")
    except click.ClickException as e:
        e.exit_code = 2  # 1 means changes
        raise
    if old is None:
        click.echo(f"{rev}: no generated/manifest.json there; every cell counts as new")
    lines = diffing.diff_manifests(old, new)
    for line in lines:
        click.echo(line)
    if not lines:
        click.echo("no changes")
    ctx.exit(1 if lines else 0)


@main.command("compile")
@_filters
@click.option("--arch", "archs", multiple=True, type=click.Choice(spec.ARCH_TARGETS),
              help="GPU architecture (repeatable); default: the manifest's targets.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel compiles (default: all cores).")
@click.option("--spills-as-warnings", is_flag=True,
              help="Report spills over the budget as warnings, not failures: for a toolchain the budgets were "
                   "not set for (NVRTC 12; the budgets are NVRTC 13's).")
@click.pass_context
def compile_cmd(ctx, families, dtypes, world_sizes, profiles, archs, jobs, spills_as_warnings):
    """Compile programs with NVRTC (no GPU needed); fail on any error or on spills over the budget."""
    from moe_ar_common import cuda_env

    from . import nvrtc_build

    generated = _generated(ctx)
    try:
        manifest = manifest_reader.load_verified_manifest(generated)
    except manifest_reader.ManifestError as e:
        raise click.ClickException(str(e)) from None
    programs = _select(manifest, families, dtypes, world_sizes, profiles)
    if not programs:
        raise click.ClickException(_none_selected(manifest, families, dtypes, world_sizes, profiles))
    archs = list(archs) or list(manifest["targets"])
    jobs = jobs or os.cpu_count() or 1
    try:  # NVRTC and its headers, from the cu12 / cu13 extra: name the extra rather than fail in the workers
        cuda_env.include_dir(cuda_env.load_nvrtc()[1][0])
    except cuda_env.MissingToolchain as e:
        raise click.ClickException(str(e)) from None
    symbols = {entry["name"]: entry["symbol"] for entry in programs}
    budgets = {entry["name"]: nvrtc_build.spill_budget(entry["register_cap"]) for entry in programs}
    if spills_as_warnings:
        budgets = dict.fromkeys(budgets, sys.maxsize)
    total = len(programs) * len(archs)
    start = time.perf_counter()
    with click.progressbar(length=total, label=f"compiling {total} (program, arch) with {jobs} jobs",
                           file=sys.stderr) as bar:
        results = nvrtc_build.compile_programs(generated, [entry["name"] for entry in programs], archs, jobs,
                                               progress=lambda _key: bar.update(1))
    wall = time.perf_counter() - start
    failed, warned = [], []
    rows = []
    for result in results:
        budget = budgets[result.program]
        issues = nvrtc_build.problems(result, symbols[result.program], budget)
        if issues:
            failed.append((result, issues))
        elif nvrtc_build.warnings(result, budget):
            warned.append(result)
        kernel = next((e for e in result.entries if e.function == symbols[result.program]), None)
        status = ("FAIL" if issues else f"ok, {len(nvrtc_build.warnings(result, budget))} warnings"
                  if result in warned else "ok")
        rows.append((result.program, result.arch, kernel.registers if kernel else "-",
                     kernel.spill_store_bytes if kernel else "-", kernel.spill_load_bytes if kernel else "-",
                     kernel.stack_bytes if kernel else "-", result.cubin_bytes or "-", f"{result.seconds:.2f}",
                     status))
    _print_rows(rows, ("program", "arch", "registers", "spill st", "spill ld", "stack", "cubin bytes",
                       "seconds", "status"))
    for result in warned:
        click.echo(f"\n==== {result.program} {result.arch}: warnings", err=True)
        click.echo("\n".join(nvrtc_build.warnings(result, budgets[result.program])), err=True)
    for result, issues in failed:
        click.echo(f"\n==== {result.program} {result.arch}: {'; '.join(issues)}", err=True)
        click.echo(result.log.rstrip(), err=True)
    click.echo(f"{len(results) - len(failed)}/{len(results)} compiled clean in {wall:.1f} s "
               f"({sum(result.seconds for result in results):.1f} s of compile time, {jobs} jobs)")
    if failed:
        ctx.exit(1)

@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def tune(args):
    """Measure this machine's table set on its GPUs: runs `python -m moe_ar_tools.tune ARGS` (its
    --help lists them) in a subprocess, so that the generator itself never imports the runtime."""
    import subprocess

    env = dict(os.environ)
    root = locations.checkout_root()
    if root is not None:  # the checkout's moe_ar_tools and dispatch, as this generator is the checkout's
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["MOE_AR_TUNE_PROG_NAME"] = "gen-programs tune"  # its usage lines name the command typed
    code = subprocess.run([sys.executable, "-m", "moe_ar_tools.tune", *args], env=env).returncode
    sys.exit(code)


if __name__ == "__main__":
    main()
