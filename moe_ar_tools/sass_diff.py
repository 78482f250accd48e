"""Compare the machine code (SASS) of every program between two revisions, paired by cell.

    python -m moe_ar_tools.sass_diff OLD_REV [NEW_REV] [--family F] [--dtype D] [--world-size W]
                                     [--profile P] [--arch A ...] [--jobs N] [--json PATH]

NEW_REV defaults to the working tree of the checkout this module runs from. Each revision's tree is
taken with `git archive REV | tar -x`, and that tree's own generator code (its `verify` module's
source_for, its `nvrtc_build` options, its manifest's compile options, its `cuda_env` headers:
found in generator/ or moe_ar_common/, wherever that revision kept them) builds its sources; NVRTC compiles them to cubins as the runtime does, `cuobjdump -sass`
disassembles them, and the two programs of a cell (family, dtype, world size, profile, from the
manifests, so a renamed program is paired with its old name) are compared after normalization
(each program's own symbol -> a placeholder, blank and fat-binary banner lines dropped, runs of
blanks made one). Per (program, arch): identical / renamed, identical (the same SASS but the
symbol) / DIFFERENT (with the first differing lines) / FAILED, plus the cells only one tree has.
Exit 1 when a paired program differs or fails to compile or disassemble, 2 when the trees cannot
be compared (a missing tool, a bad revision, a stale manifest).

cuobjdump and the nvdisasm it runs come with the `test` extra (nvidia-cuda-cuobjdump,
nvidia-cuda-nvdisasm), or from a CUDA toolkit ($CUDA_HOME/bin, PATH). SASS is cached per
(source sha256, arch) under the temporary folder, so a rerun compiles only what changed.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import click

from generator.cli import _filters, _none_selected, _select
from generator.spec import ARCH_TARGETS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLACEHOLDER = "<program>"
IDENTICAL = "identical"
RENAMED = "renamed, identical"  # another symbol, the same SASS once each is the placeholder
DIFFERENT = "DIFFERENT"
FAILED = "FAILED"
DIFF_LINES = 24  # differing lines shown per DIFFERENT (program, arch)
DEFAULT_CACHE = pathlib.Path(tempfile.gettempdir()) / "moe_ar_sass_cache"
TOOLS_HINT = ("install the test extra (pip install -e '.[test]': nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm), "
              "or put a CUDA toolkit's bin/ on PATH")


class CannotCompare(click.ClickException):
    """The comparison could not be made (exit 2; exit 1 means a paired program differs)."""
    exit_code = 2


# ---- normalization and comparison (pure; tests/test_sass_diff_cpu.py) ---------------------------

# cuobjdump's banner of a fat binary's member: its file name, offsets and producer may differ between
# two builds of the same code (a cubin disassembled alone has none of these lines).
_BANNER = re.compile(r"^(Fatbin \w+ code:|=+|arch = |code version = |host = |compile_size = |identifier = |"
                     r"ptxasOptions = )")


def normalize(sass: str, symbol: str | None = None) -> list[str]:
    """The SASS lines that describe the code: symbol (the program's own kernel name) replaced by a
    placeholder wherever it appears (the Function line, its internal functions' names), runs of blanks
    made one (column padding follows the longest line), blank and banner lines dropped."""
    out = []
    for line in sass.splitlines():
        if symbol:
            line = line.replace(symbol, PLACEHOLDER)
        line = " ".join(line.split())
        if line and not _BANNER.match(line):
            out.append(line)
    return out


@dataclasses.dataclass(frozen=True)
class Comparison:
    status: str               # IDENTICAL, RENAMED or DIFFERENT
    diff: tuple[str, ...]     # the first differing lines (unified diff, old -> new) when DIFFERENT


def compare(old_sass: str, old_symbol: str, new_sass: str, new_symbol: str) -> Comparison:
    """identical (the same text), renamed, identical (the same once each program's own symbol is the
    placeholder), or DIFFERENT with the first lines that differ."""
    if normalize(old_sass) == normalize(new_sass):
        return Comparison(IDENTICAL, ())
    old, new = normalize(old_sass, old_symbol), normalize(new_sass, new_symbol)
    if old == new:
        return Comparison(RENAMED, ())
    diff = difflib.unified_diff(old, new, "old", "new", n=2, lineterm="")
    return Comparison(DIFFERENT, tuple(line for _, line in zip(range(DIFF_LINES), diff)))


def cell_of(entry: dict) -> tuple:
    """The table cell of a manifest program entry: (family, dtype, world size, profile)."""
    return (entry["family"], entry["dtype"], entry["world_size"], entry["profile"])


def cell_label(cell: tuple) -> str:
    family, dtype, world_size, profile = cell
    return f"{family} {dtype} ws{world_size} {profile}"


def pair(old: list[dict], new: list[dict]) -> tuple[list[tuple[dict, dict]], list[dict], list[dict]]:
    """Programs of the two manifests paired by cell, in the new manifest's order; then the entries of
    cells only the old one has, and of cells only the new one has. ValueError naming a manifest with
    two programs in one cell."""
    for which, entries in (("old", old), ("new", new)):
        seen = {}
        for entry in entries:
            other = seen.setdefault(cell_of(entry), entry["name"])
            if other != entry["name"]:
                raise ValueError(f"{which}: two programs in cell {cell_label(cell_of(entry))}: {other}, {entry['name']}")
    old_by_cell = {cell_of(entry): entry for entry in old}
    new_cells = {cell_of(entry) for entry in new}
    pairs = [(old_by_cell[cell_of(entry)], entry) for entry in new if cell_of(entry) in old_by_cell]
    return (pairs, [entry for entry in old if cell_of(entry) not in new_cells],
            [entry for entry in new if cell_of(entry) not in old_by_cell])


def counts(rows: list[dict], archs: list[str]) -> dict[str, dict[str, int]]:
    """Per arch: how many (program, arch) rows have each status."""
    out = {arch: dict.fromkeys((IDENTICAL, RENAMED, DIFFERENT, FAILED), 0) for arch in archs}
    for row in rows:
        out[row["arch"]][row["status"]] += 1
    return out


def clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def time_left(elapsed: float, done: int, remaining: int) -> float | None:
    """Seconds left at the pace so far (None before the first compile finishes)."""
    return elapsed / done * remaining if done else None


# ---- the cubin and its SASS --------------------------------------------------------------------

def complete_cubin(cubin: bytes) -> bytes:
    """The cubin with the zero bytes CuPy's getCUBIN leaves off put back. CuPy returns NVRTC's cubin
    less its last byte (as if it ended a string); the ELF's header tables come last, so the program
    header table then runs past the end and cuobjdump reads no device code. ValueError unless the
    missing bytes lie in a header table and every section's data is present."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("cubin: not a 64-bit little-endian ELF")
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    tables = [(phoff, phoff + phnum * phentsize), (shoff, shoff + shnum * shentsize)]
    end = max(stop for _, stop in tables)
    if end <= len(cubin):
        return cubin
    if not any(start <= len(cubin) < stop for start, stop in tables) or shoff + shnum * shentsize > len(cubin):
        raise ValueError(f"cubin: {end - len(cubin)} bytes short, not only in its program header table")
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", cubin, shoff + i * shentsize + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", cubin, shoff + i * shentsize + 0x18)
        if sh_type != 8 and sh_offset + sh_size > len(cubin):  # 8: SHT_NOBITS, no data in the file
            raise ValueError(f"cubin: section {i} runs past the end of the cubin")
    return cubin + bytes(end - len(cubin))


def compile_cubin(source: str, program: str, options: tuple[str, ...]) -> tuple[bytes | None, str]:
    """NVRTC through CuPy, as the runtime and `gen-programs compile` call it: (cubin, log), cubin None
    on a compile error. Their own functions keep the cubin to themselves, hence this call."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, f"{program}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
        log = (log.decode("utf-8", "replace") if isinstance(log, bytes) else log).rstrip("\x00")
        return (nvrtc.getCUBIN(prog) if ok else None), log
    finally:
        nvrtc.destroyProgram(prog)


def find_tool(name: str) -> pathlib.Path | None:
    """A CUDA binary tool: pip's (nvidia/cu<major>/bin newest first, nvidia/cuda_<name>/bin), then
    $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin."""
    dirs = []
    try:
        import nvidia  # namespace package of pip's nvidia-* wheels
        roots = [pathlib.Path(p) for p in nvidia.__path__]
    except ImportError:
        roots = []
    for root in roots:
        majors = sorted(root.glob("cu[0-9]*"), key=lambda p: -int(p.name[2:]) if p.name[2:].isdigit() else 0)
        dirs += [p / "bin" for p in majors] + [root / f"cuda_{name}" / "bin"]
    dirs += [pathlib.Path(os.environ[v]) / "bin" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    found = shutil.which(name)
    dirs += [pathlib.Path(found).parent] if found else []
    dirs.append(pathlib.Path("/usr/local/cuda/bin"))
    for d in dirs:
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    return None


@dataclasses.dataclass(frozen=True)
class Tools:
    cuobjdump: str
    nvdisasm: str

    def version(self) -> str:
        """cuobjdump's release line and nvdisasm's (the SASS text is theirs)."""
        def line(tool):
            out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
            return next((l.strip() for l in out.splitlines() if "release" in l), out.strip().splitlines()[-1])
        return f"cuobjdump: {line(self.cuobjdump)}; nvdisasm: {line(self.nvdisasm)}"


def find_tools() -> Tools:
    """cuobjdump and nvdisasm (cuobjdump -sass runs it); CannotCompare naming the extra."""
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    missing = [n for n, p in (("cuobjdump", cuobjdump), ("nvdisasm", nvdisasm)) if p is None]
    if missing:
        raise CannotCompare(f"{' and '.join(missing)} not found; {TOOLS_HINT}")
    return Tools(str(cuobjdump), str(nvdisasm))


def disassemble(cubin: bytes, tools: Tools) -> str:
    """`cuobjdump -sass` of one cubin. RuntimeError with cuobjdump's message when it fails."""
    with tempfile.TemporaryDirectory(prefix="moe_ar_sass_") as tmp:
        path = pathlib.Path(tmp) / "program.cubin"
        path.write_bytes(complete_cubin(cubin))
        env = dict(os.environ, NVDISASM_PATH=str(pathlib.Path(tools.nvdisasm).parent))
        r = subprocess.run([tools.cuobjdump, "-sass", str(path)], capture_output=True, text=True, env=env)
    if r.returncode != 0 or "Function :" not in r.stdout:
        raise RuntimeError(f"cuobjdump -sass failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    return r.stdout


# ---- one (program, arch) of one tree: compile, disassemble, cache ------------------------------

@dataclasses.dataclass(frozen=True)
class Build:
    """What NVRTC compiles for one (program, arch) of one tree."""
    tree: str                 # "old" or "new"
    program: str
    arch: str
    source: str
    options: tuple[str, ...]

    def cache_name(self, toolchain: str) -> str:
        """<source sha256>-<arch>-<options and toolchain>.json: one entry per (source, arch) of a toolchain."""
        source = hashlib.sha256(self.source.encode()).hexdigest()
        rest = hashlib.sha256("\0".join((*self.options, toolchain)).encode()).hexdigest()
        return f"{source[:24]}-{self.arch}-{rest[:12]}.json"


def build_sass(build: Build, tools: Tools, cache: pathlib.Path | None, toolchain: str) -> dict:
    """Runs in a worker: {"sass", "cubin_sha256", "seconds"} or {"error"}; stored in the cache when it worked."""
    start = time.perf_counter()
    cubin, log = compile_cubin(build.source, build.program, build.options)
    if cubin is None:
        return {"error": f"NVRTC error:\n{log.strip()[-4000:]}"}
    try:
        sass = disassemble(cubin, tools)
    except (RuntimeError, ValueError) as e:
        return {"error": str(e)}
    result = {"sass": sass, "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
              "seconds": round(time.perf_counter() - start, 2)}
    if cache is not None:
        tmp = cache / f".{build.cache_name(toolchain)}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, cache / build.cache_name(toolchain))
    return result


def usable_cache(path: pathlib.Path) -> pathlib.Path | None:
    """The cache folder, created 0700; None (with a warning) when it is not this user's alone."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        click.echo(f"sass_diff: not caching in {path}: {e}", err=True)
        return None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        click.echo(f"sass_diff: not caching in {path}: owned by another user or writable by others", err=True)
        return None
    return path


def cached(build: Build, cache: pathlib.Path | None, toolchain: str) -> dict | None:
    if cache is None:
        return None
    try:
        entry = json.loads((cache / build.cache_name(toolchain)).read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("sass"), str) else None


def run_builds(builds: list[Build], tools: Tools, cache: pathlib.Path | None, toolchain: str,
               jobs: int) -> dict[tuple[str, str, str], dict]:
    """{(tree, program, arch): result} of every build: from the cache, else compiled in a process pool
    (builds of the same source, arch and options once), one progress line a compile on stderr with
    the time left."""
    by_key: dict[str, list[Build]] = {}
    for build in builds:
        by_key.setdefault(build.cache_name(toolchain), []).append(build)
    results, todo = {}, []
    for same in by_key.values():
        hit = cached(same[0], cache, toolchain)
        if hit is None:
            todo.append(same)
            continue
        for build in same:
            results[(build.tree, build.program, build.arch)] = dict(hit, cached=True)
    click.echo(f"sass_diff: {len(builds)} (program, arch) builds, {len(by_key)} distinct: "
               f"{len(by_key) - len(todo)} cached, {len(todo)} to compile with {jobs} jobs", err=True)
    if not todo:
        return results
    start = time.perf_counter()
    # spawn: workers start clean (no inherited CUDA state), as gen-programs compile's.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(build_sass, same[0], tools, cache, toolchain): same for same in todo}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            same = futures[future]
            result = future.result()
            for build in same:
                results[(build.tree, build.program, build.arch)] = result
            elapsed = time.perf_counter() - start
            what = f"FAILED: {result['error'].splitlines()[0]}" if "error" in result else f"{result['seconds']:.1f} s"
            trees = "+".join(build.tree for build in same)
            click.echo(f"[{done:{len(str(len(todo)))}}/{len(todo)}] {trees} {same[-1].program} {same[0].arch}: "
                       f"{what} | {clock(elapsed)} elapsed, about {clock(time_left(elapsed, done, len(todo) - done))} "
                       f"left", err=True)
    return results


# ---- the two trees -----------------------------------------------------------------------------

@dataclasses.dataclass
class Tree:
    label: str                # what was asked for: the revision, or "working tree"
    describe: str             # the commit it is (and whether the working tree has changes)
    root: pathlib.Path
    generator: object = None  # the tree's own generator package, loaded under its own name

    def module(self, name: str):
        try:
            return importlib.import_module(f"{self.generator.__name__}.{name}")
        except ModuleNotFoundError:
            # a tree whose manifest reader and CUDA environment live in moe_ar_common/
            shared = {"verify": "manifest_reader", "cuda_env": "cuda_env"}[name]
            alias = f"{self.generator.__name__}_common_{shared}"
            if alias not in sys.modules:
                spec = importlib.util.spec_from_file_location(alias, self.root / "moe_ar_common" / f"{shared}.py")
                module = importlib.util.module_from_spec(spec)
                sys.modules[alias] = module
                spec.loader.exec_module(module)
            return sys.modules[alias]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def export(rev: str, dest: pathlib.Path) -> Tree:
    """`git archive REV | tar -x -C dest`; CannotCompare for a name that is not a revision."""
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise CannotCompare(f"{rev!r} is not a git revision of {ROOT}") from None
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    extract = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or extract.returncode != 0:
        raise CannotCompare(f"git archive {rev} | tar -x failed")
    return Tree(rev, f"{rev} = {commit}", dest)


def working_tree() -> Tree:
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return Tree("working tree", f"working tree of {ROOT} at {head}" + (" with uncommitted changes" if dirty else ""),
                ROOT)


def load_generator(tree: Tree, alias: str) -> None:
    """Import the tree's generator/ as package `alias`: its modules import one another relatively,
    so the tree's verify, nvrtc_build and cuda_env build the tree's own sources."""
    init = tree.root / "generator" / "__init__.py"
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(init.parent)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[alias] = package
    spec.loader.exec_module(package)
    tree.generator = package


def builds_of(tree: Tree, which: str, entries: list[dict], archs: list[str]) -> list[Build]:
    """Each program's source (the tree's verify.source_for, on its checked manifest) and NVRTC options
    (the tree's nvrtc_build.options with its manifest's compile options and the CUDA headers of
    NVRTC's major version), per arch."""
    verify, nvrtc_build, cuda_env = (tree.module(n) for n in ("verify", "nvrtc_build", "cuda_env"))
    generated = tree.root / "generated"
    manifest = verify.load_verified_manifest(generated)
    include_dir = cuda_env.include_dir(cuda_env.load_nvrtc()[1][0])
    return [Build(which, entry["name"], arch, verify.source_for(manifest, generated, entry["name"]),
                  tuple(nvrtc_build.options(arch, include_dir, manifest["compile_options"])))
            for entry in entries for arch in archs]


def manifest_of(tree: Tree) -> dict:
    verify = tree.module("verify")
    try:
        return verify.load_verified_manifest(tree.root / "generated")
    except verify.ManifestError as e:
        raise CannotCompare(f"{tree.label}: {e}") from None


def nvrtc_version() -> str:
    from moe_ar_common import cuda_env

    try:
        _nvrtc, version = cuda_env.load_nvrtc()
    except cuda_env.MissingToolchain as e:
        raise CannotCompare(str(e)) from None
    packages = []
    for name in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
        try:
            packages.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"NVRTC {version[0]}.{version[1]}" + (f" ({', '.join(packages)})" if packages else "")


# ---- the report --------------------------------------------------------------------------------

def compare_all(pairs: list[tuple[dict, dict]], archs: list[str], results: dict) -> list[dict]:
    """One row per (paired program, arch): cell, names, status, diff or error."""
    rows = []
    for old, new in pairs:
        for arch in archs:
            row = {"cell": dict(zip(("family", "dtype", "world_size", "profile"), cell_of(new))), "arch": arch,
                   "old": old["name"], "new": new["name"]}
            a, b = results[("old", old["name"], arch)], results[("new", new["name"], arch)]
            errors = [f"{which}: {r['error']}" for which, r in (("old", a), ("new", b)) if "error" in r]
            if errors:
                row.update(status=FAILED, error="\n".join(errors))
            else:
                comparison = compare(a["sass"], old["symbol"], b["sass"], new["symbol"])
                row["status"] = comparison.status
                if comparison.diff:
                    row["diff"] = list(comparison.diff)
            rows.append(row)
    return rows


def summary_lines(report: dict) -> list[str]:
    """The text report: one line per (program, arch), problems in full, counts per arch, the verdict."""
    rows, archs = report["rows"], report["archs"]
    lines = [f"old: {report['old']}", f"new: {report['new']}", f"{report['nvrtc']}; {report['tools']}", ""]
    width = max([len(r["new"]) for r in rows] + [7])
    for row in rows:
        renamed = f"  (old: {row['old']})" if row["old"] != row["new"] else ""
        lines.append(f"{row['new']:<{width}}  {row['arch']:<7}  {row['status']}{renamed}")
    for row in rows:
        if row["status"] in (DIFFERENT, FAILED):
            lines += ["", f"==== {row['new']} {row['arch']}: {row['status']}", *row.get("diff", []),
                      *row.get("error", "").splitlines()]
    lines.append("")
    for which in ("only_old", "only_new"):
        for entry in report[which]:
            lines.append(f"cell only in the {which[5:]} tree: {entry['cell']} ({entry['name']})")
    if not report["only_old"] and not report["only_new"]:
        lines.append("every cell selected in one tree has a program in the other")
    for arch, by_status in report["counts"].items():
        n = sum(by_status.values())
        lines.append(f"{arch}: {n} paired programs: " + ", ".join(f"{v} {k}" for k, v in by_status.items()))
    total = len(rows)
    same = sum(r["status"] in (IDENTICAL, RENAMED) for r in rows)
    lines.append(f"{same} of {total} (program, arch) the same SASS ("
                 f"{sum(r['status'] == IDENTICAL for r in rows)} identical, "
                 f"{sum(r['status'] == RENAMED for r in rows)} renamed, identical but the symbol name); "
                 f"{total - same} differ or failed; archs {', '.join(archs)}")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("old_rev")
@click.argument("new_rev", required=False)
@_filters
@click.option("--arch", "archs", multiple=True, type=click.Choice(ARCH_TARGETS),
              help="GPU architecture (repeatable); default: the new manifest's targets.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel compiles (default: all cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=pathlib.Path), default=None,
              help="Write the full per-(program, arch) result here as JSON.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=pathlib.Path), default=DEFAULT_CACHE,
              show_default=True, help="SASS cache, one entry per (source sha256, arch).")
@click.option("--no-cache", is_flag=True, help="Compile everything; read and write no cache.")
def main(old_rev, new_rev, families, dtypes, world_sizes, profiles, archs, jobs, json_path, cache_dir, no_cache):
    """Compare the SASS of every program (or those the filters select) of OLD_REV and NEW_REV
    (default: the working tree), paired by cell; exit 1 when a paired program differs."""
    tools = find_tools()
    nvrtc = nvrtc_version()
    tool_versions = tools.version()
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="moe_ar_sass_trees_") as tmp:
        old = export(old_rev, pathlib.Path(tmp) / "old")
        new = export(new_rev, pathlib.Path(tmp) / "new") if new_rev else working_tree()
        for which, tree in (("old", old), ("new", new)):
            load_generator(tree, f"_sass_diff_{which}_generator")
        manifests = {which: manifest_of(tree) for which, tree in (("old", old), ("new", new))}
        selected = {which: _select(m, families, dtypes, world_sizes, profiles) for which, m in manifests.items()}
        pairs, only_old, only_new = pair(selected["old"], selected["new"])
        if not selected["new"]:
            raise CannotCompare(_none_selected(manifests["new"], families, dtypes, world_sizes, profiles))
        if not pairs:
            raise CannotCompare("no program of the new tree has a cell in the old one")
        archs = list(archs) or list(manifests["new"]["targets"])
        builds = [*builds_of(old, "old", [o for o, _ in pairs], archs), *builds_of(new, "new", [n for _, n in pairs], archs)]
    toolchain = f"{nvrtc}; {tool_versions}"
    results = run_builds(builds, tools, None if no_cache else usable_cache(cache_dir), toolchain, jobs)
    rows = compare_all(pairs, archs, results)
    report = {"old": old.describe, "new": new.describe, "nvrtc": nvrtc, "tools": tool_versions, "archs": archs,
              "filters": {"family": list(families), "dtype": list(dtypes), "world_size": list(world_sizes),
                          "profile": list(profiles)},
              "counts": counts(rows, archs), "rows": rows,
              "only_old": [{"cell": cell_label(cell_of(e)), "name": e["name"]} for e in only_old],
              "only_new": [{"cell": cell_label(cell_of(e)), "name": e["name"]} for e in only_new]}
    for line in summary_lines(report):
        click.echo(line)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
    if any(row["status"] in (DIFFERENT, FAILED) for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
