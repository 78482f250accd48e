"""gen-programs: regenerate, check, list, show, diff and compile the programs.

    gen-programs                 regenerate generated/
    gen-programs --check         fail (exit 1, with the diff) when generated/ is stale
    gen-programs list [filters]  programs: name, protocol class, file
    gen-programs tables          every family as a grid, holes and fallbacks shown
    gen-programs diff REV        table cells changed since git revision REV
    gen-programs compile [filters] [--arch A ...] [--jobs N]
                                 NVRTC-compile programs, print registers/spills

In a source checkout (or an editable install) these read and write the checkout's generated/.
Installed from a wheel, they read the installed tree (package data, generator/locations.py);
regenerating then needs --out DIR, and diff a repository.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

import click

from . import locations, spec, tuning, verify


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
        return verify.load_manifest(generated)
    except verify.ManifestError as e:
        raise click.ClickException(str(e)) from None


def _filters(fn):
    fn = click.option("--profile", "profiles", multiple=True, type=click.Choice(spec.OUTPUT_PROFILES),
                      help="Output profile (repeatable).")(fn)
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
    return [p for p in manifest["programs"]
            if keep(families, p["family"]) and keep(dtypes, p["dtype"])
            and keep(world_sizes, str(p["world_size"])) and keep(profiles, p["profile"])]


def _none_selected(manifest: dict, families, dtypes, world_sizes, profiles) -> str:
    """Why the filters select no program: the holes they match, each with its reason and the family
    whose program runs there instead."""
    def keep(values, value):
        return not values or value in values
    holes = [h for h in manifest["holes"]
             if keep(families, h["family"]) and keep(dtypes, h["dtype"])
             and keep(world_sizes, str(h["world_size"])) and keep(profiles, h["profile"])]
    if not holes:
        return "no program matches the filters"
    groups: dict[tuple, list[dict]] = {}
    for h in holes:
        groups.setdefault((h["family"], h["reason"], h["fallback_family"]), []).append(h)
    lines = []
    for (family, reason, fallback), cells in groups.items():
        where = []  # the axes the filters named, and those on which these holes are a part of the cells asked for
        for axis, label, given in (("dtype", "dtype", dtypes), ("world_size", "world size", world_sizes),
                                   ("profile", "profile", profiles)):
            values = sorted({str(c[axis]) for c in cells}, key=lambda v: (len(v), v))
            asked = set(given) or {str(v) for v in manifest["axes"][f"{axis}s" if axis != "profile" else "output_profiles"]}
            if given or set(values) != asked:
                where.append(f"{label}{'s' if len(values) > 1 else ''} {'/'.join(values)}")
        at = f" at {', '.join(where)}" if where else ""
        lines.append(f"{family} has no program{at} (hole: {reason}); calls there run {fallback}")
    return "\n".join(lines)


def _print_rows(rows: list[tuple], header: tuple) -> None:
    rows = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


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
    start = time.perf_counter()
    result = render.render_all(root)
    dest = out or root / "generated"
    n_programs, n_holes = len(result.enumeration.programs), len(result.enumeration.holes)
    if check:
        diffs = render.check_tree(result.outputs, dest)
        if diffs:
            for d in diffs:
                click.echo(d, nl=False)
            click.echo(f"{dest.name}/ is stale: {len(diffs)} file(s) differ; {verify.REGENERATE}", err=True)
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
    """List programs: name, protocol class, file (from generated/manifest.json)."""
    manifest = _manifest(_generated(ctx))
    programs = _select(manifest, families, dtypes, world_sizes, profiles)
    if not programs:
        raise click.ClickException(_none_selected(manifest, families, dtypes, world_sizes, profiles))
    _print_rows([(p["name"], p["protocol_class"], f"generated/{p['file']}") for p in programs],
                ("name", "protocol class", "file"))


@main.command()
@click.pass_context
def tables(ctx):
    """Every family as a grid: rows dtype x world size, columns output profiles."""
    manifest = _manifest(_generated(ctx))
    axes = manifest["axes"]
    programs = {(p["family"], p["dtype"], p["world_size"], p["profile"]): p for p in manifest["programs"]}
    holes = {(h["family"], h["dtype"], h["world_size"], h["profile"]): h for h in manifest["holes"]}
    for family in axes["families"]:
        click.echo(f"{family}  (tables/{family}.h, base {axes['base_family'][family]}, "
                   f"protocol {axes['protocol'][family]})")
        click.echo(f"  {axes['family_meaning'][family]}")
        rows, reasons = [], {}
        for dtype in axes["dtypes"]:
            for ws in axes["world_sizes"]:
                row = [f"{dtype} ws{ws}"]
                for profile in axes["output_profiles"]:
                    key = (family, dtype, ws, profile)
                    if key in programs:
                        row.append(programs[key]["name"])
                    else:
                        hole = holes[key]
                        mark = reasons.setdefault(hole["reason"], f"[{len(reasons) + 1}]")
                        row.append(f"-- hole{mark} -> {hole['fallback_family']}")
                rows.append(row)
        header = ["  "] + [spec.profile_tag(p) for p in axes["output_profiles"]]
        rows = [["  " + r[0], *r[1:]] for r in rows]
        _print_rows(rows, tuple(header))
        for reason, mark in reasons.items():
            click.echo(f"  hole{mark}: {reason}")
        click.echo()
    sel = manifest["selection"]
    click.echo(f"selection ({sel['table']}, source: {sel['source']}): "
               "oneshot_max_tokens / early_max_tokens / twoshot_max_tokens / loads_max_tokens (all: no bound)")
    click.echo(f"  {sel['rule']}")
    bounds = {(b["dtype"], b["world_size"], b["profile"]): b for b in sel["boundaries"]}
    rows = []
    for dtype in axes["dtypes"]:
        for ws in axes["world_sizes"]:
            row = [f"  {dtype} ws{ws}"]
            for profile in axes["output_profiles"]:
                b = bounds[(dtype, ws, profile)]
                mark = "" if b["source"].startswith("measured") else " (model)"
                shown = ["all" if b[k] == tuning.ALL_TOKENS else str(b[k])
                         for k in ("oneshot_max_tokens", "early_max_tokens", "twoshot_max_tokens", "loads_max_tokens")]
                row.append(" / ".join(shown) + mark)
            rows.append(row)
    _print_rows(rows, tuple(["  "] + [spec.profile_tag(p) for p in axes["output_profiles"]]))
    click.echo("  (model): no measurement covers the cell; the written model in generator/tuning.py decides")


@main.command()
@click.argument("rev")
@click.pass_context
def diff(ctx, rev):
    """Cells changed between the manifest committed at REV and generated/ now."""
    from . import diffing

    root = locations.checkout_root()
    if root is None:
        raise _installed_only("diff (it reads the git history)")
    new = _manifest(_generated(ctx))
    try:
        old = diffing.manifest_at(rev, root)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if old is None:
        click.echo(f"{rev}: no generated/manifest.json there; every cell counts as new")
    lines = diffing.diff_manifests(old, new)
    for line in lines:
        click.echo(line)
    if not lines:
        click.echo("no changes")


@main.command("compile")
@_filters
@click.option("--arch", "archs", multiple=True, type=click.Choice(spec.ARCH_TARGETS),
              help="GPU architecture (repeatable); default: the manifest's targets.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel compiles (default: all cores).")
@click.pass_context
def compile_cmd(ctx, families, dtypes, world_sizes, profiles, archs, jobs):
    """Compile programs with NVRTC (no GPU needed); fail on any error or on spills over the budget."""
    from . import cuda_env, nvrtc_build

    generated = _generated(ctx)
    try:
        manifest = verify.load_verified_manifest(generated)
    except verify.ManifestError as e:
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
    symbols = {p["name"]: p["symbol"] for p in programs}
    budgets = {p["name"]: nvrtc_build.spill_budget(p["register_cap"]) for p in programs}
    total = len(programs) * len(archs)
    start = time.perf_counter()
    with click.progressbar(length=total, label=f"compiling {total} (program, arch) with {jobs} jobs",
                           file=sys.stderr) as bar:
        results = nvrtc_build.compile_programs(generated, [p["name"] for p in programs], archs, jobs,
                                               progress=lambda _key: bar.update(1))
    wall = time.perf_counter() - start
    failed, warned = [], []
    rows = []
    for r in results:
        budget = budgets[r.program]
        issues = nvrtc_build.problems(r, symbols[r.program], budget)
        if issues:
            failed.append((r, issues))
        elif nvrtc_build.warnings(r, budget):
            warned.append(r)
        entry = next((e for e in r.entries if e.function == symbols[r.program]), None)
        rows.append((r.program, r.arch, entry.registers if entry else "-",
                     entry.spill_store_bytes if entry else "-", entry.spill_load_bytes if entry else "-",
                     entry.stack_bytes if entry else "-", r.cubin_bytes or "-", f"{r.seconds:.2f}",
                     "FAIL" if issues else f"ok, {len(nvrtc_build.warnings(r, budget))} warnings" if r in warned else "ok"))
    _print_rows(rows, ("program", "arch", "registers", "spill st", "spill ld", "stack", "cubin bytes",
                       "seconds", "status"))
    for r in warned:
        click.echo(f"\n==== {r.program} {r.arch}: warnings", err=True)
        click.echo("\n".join(nvrtc_build.warnings(r, budgets[r.program])), err=True)
    for r, issues in failed:
        click.echo(f"\n==== {r.program} {r.arch}: {'; '.join(issues)}", err=True)
        click.echo(r.log.rstrip(), err=True)
    click.echo(f"{len(results) - len(failed)}/{len(results)} compiled clean in {wall:.1f} s "
               f"({sum(r.seconds for r in results):.1f} s of compile time, {jobs} jobs)")
    if failed:
        ctx.exit(1)


if __name__ == "__main__":
    main()
