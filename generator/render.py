"""Render templates/ into the files of generated/, byte-deterministically.

`render_all(root)` returns every output as {relative path: bytes}; nothing is
written. `write_tree` writes only files whose bytes changed and removes stale
ones; `compare_tree` is the `--check` gate.

Every rendered file starts with a do-not-edit header naming its template, the
generator and how to regenerate it. The kernel body's hand-written headers
(kernels/*.cuh) are copied into generated/kernels/ byte for byte, next to the
rendered params.cuh. Only the manifest carries `inputs_sha256` (a hash over the
relative paths and contents of every input: generator/*.py, moe_ar_common/*.py,
templates/*, kernels/*, the benchmark results; never absolute paths, never
timestamps), so an input change that renders the same text rewrites the manifest
alone.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import pathlib
import tempfile

import jinja2

from moe_ar_common.manifest_reader import MANIFEST_NAME, REGENERATE, ManifestError, inline_includes

from . import abi, manifest, selection_map, spec, table_sets, tuning
from .code_hash import code_sha256
from .enumeration import Enumeration, enumerate_programs

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATOR = "gen-programs, generator/"

PARAMS_TEMPLATE = "params.cuh.j2"
PROGRAM_TEMPLATE = "program.cu.j2"
SELECTION_TEMPLATE = "selection.h.j2"
SELECTION_MAP_TEMPLATE = "selection_map.svg.j2"

# The kernel body: hand-written headers in KERNEL_DIR (repository) = BODY_DIR (generated/), where
# params.cuh is rendered next to them; a program includes BODY_ENTRY, which includes the rest.
KERNEL_DIR = "kernels"
BODY_DIR = "kernels"
BODY_ENTRY = f"{BODY_DIR}/moe_finalize_allreduce.cuh"
PARAMS_FILE = f"{BODY_DIR}/params.cuh"
SELECTION_MAP_FILE = "selection_map.svg"


# ---- inputs -------------------------------------------------------------------------

CODE_PACKAGES = ("generator", "moe_ar_common")  # the code among the inputs (the manifest reader inlines the body)


def _inputs(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Repo-relative POSIX path -> file, of everything that decides the output: the code (root's
    CODE_PACKAGES; under an installed wheel's moe_ar_data, which has none, the installed packages
    beside this one, the same files), the templates, the kernel headers and the benchmark under root."""
    root = pathlib.Path(root)
    beside = pathlib.Path(__file__).resolve().parent.parent
    found = {}
    for package in CODE_PACKAGES:
        code = root / package if (root / package).is_dir() else beside / package
        found.update((f"{package}/{p.name}", p) for p in code.glob("*.py") if p.is_file())
    found.update((p.relative_to(root).as_posix(), p) for folder in ("templates", KERNEL_DIR)
                 for p in (root / folder).rglob("*")
                 if p.is_file() and not any(part.startswith(".") or part == "__pycache__"
                                            for part in p.relative_to(root).parts))
    # the measurements the table sets are fitted to
    found.update((p.relative_to(root).as_posix(), p) for p in table_sets.input_files(root))
    return found


def input_files(root: pathlib.Path) -> list[str]:
    """Repo-relative POSIX paths of everything that decides the output, sorted."""
    return sorted(_inputs(root))


def inputs_sha256(root: pathlib.Path) -> str:
    h = hashlib.sha256()
    inputs = _inputs(root)
    for rel in sorted(inputs):
        data = inputs[rel].read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def cpp_header(template: str) -> str:
    return (f"// GENERATED FILE, DO NOT EDIT: written by {GENERATOR} from templates/{template}.\n"
            f"// To change it, edit the template or generator/ and run `gen-programs`.\n")


def svg_header(template: str) -> str:
    return (f"<!-- GENERATED FILE, DO NOT EDIT: written by {GENERATOR} from templates/{template}.\n"
            f"     To change it, edit the template or generator/ and run `gen-programs`. -->\n")


def json_header(inputs: str) -> dict:
    return {
        "do_not_edit": "GENERATED FILE, DO NOT EDIT; edit generator/, templates/ or kernels/ and run `gen-programs`",
        "generator": GENERATOR,
        "template": "none: generator/manifest.py writes this file",
        "inputs_sha256": inputs,
    }


def make_environment(root: pathlib.Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(pathlib.Path(root) / "templates")),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


class GenerateError(RuntimeError):
    """Generation cannot proceed (a bad destination, a bad template)."""


# ---- outputs ------------------------------------------------------------------------

class Outputs:
    """Relative path -> bytes; a path may be produced once only."""

    def __init__(self):
        self._files: dict[str, bytes] = {}

    def add(self, rel: str, data: bytes | str) -> None:
        rel = pathlib.PurePosixPath(rel).as_posix()
        if pathlib.PurePosixPath(rel).is_absolute() or ".." in pathlib.PurePosixPath(rel).parts:
            raise ValueError(f"output path {rel!r} must stay inside generated/")
        if rel in self._files:
            raise ValueError(f"output {rel!r} produced twice")
        self._files[rel] = data.encode("utf-8") if isinstance(data, str) else data

    def __getitem__(self, rel: str) -> bytes:
        return self._files[rel]

    def __contains__(self, rel: str) -> bool:
        return rel in self._files

    def __len__(self) -> int:
        return len(self._files)

    def items(self):
        return sorted(self._files.items())

    def as_dict(self) -> dict[str, bytes]:
        return dict(self.items())


@dataclasses.dataclass(frozen=True)
class Result:
    outputs: Outputs
    enumeration: Enumeration
    inputs_sha256: str


def _cell_label(dtype: str, world_size: int, profile: str) -> str:
    return f"{dtype} ws{world_size} {profile}"


def _stamp_line(source: dict) -> str:
    """One measurement file and what its stamp says of the machine, in a line."""
    stamp = source["stamp"]
    gpu, link = stamp.get("gpu") or {}, stamp.get("interconnect") or {}
    parts = [f"{gpu.get('product')} x{gpu.get('count')}"]
    if gpu.get("capability"):
        parts.append(f"sm {gpu['capability']}")
    if link.get("kind"):
        parts.append(str(link["kind"]))
    if link.get("peer_bandwidth_GBps"):
        parts.append(f"peer {link['peer_bandwidth_GBps']:.0f} GB/s")
    parts += [f"{name} {stamp[name]}" for name in ("driver", "cuda", "torch", "nvrtc", "commit") if stamp.get(name)]
    return f"{source['file']}: {', '.join(parts)}"


def _shown_limits(limits) -> str:
    return ", ".join("kAllTokens" if bound == tuning.ALL_TOKENS else str(bound) for bound in limits)


_KEY_CPP = {"tokens": "kTokens", "bytes_per_rank": "kBytesPerRank"}


def _space_grid(table_set: table_sets.TableSet, local: bool) -> dict:
    """One of a selection header's two grids: world size 1 with the local rungs' boundaries (every
    exchange rung runs local there, so theirs decide nothing), or the exchange world sizes with the
    exchange rungs' (the local rungs' are 0 there: checked)."""
    world_sizes = (spec.LOCAL_WORLD_SIZE,) if local else spec.EXCHANGE_WORLD_SIZES
    rungs = slice(0, spec.LOCAL_RUNGS) if local else slice(spec.LOCAL_RUNGS, None)
    rows, own = [], []  # own: the cells' boundaries of their own per hidden size, in table order
    for dtype in spec.DTYPES:
        worlds = []
        for world_size in world_sizes:
            entries = []
            for profile in spec.OUTPUT_PROFILES:
                cell = table_set.boundaries[(dtype, world_size, profile)]
                label = _cell_label(dtype, world_size, profile)
                if not local and any(cell.limits_at(hidden)[:spec.LOCAL_RUNGS] != tuning.NO_LOCAL_TOKENS
                                     for hidden in (None, *(h for h, _, _ in cell.by_hidden))):
                    raise GenerateError(f"table set {table_set.name}, {label}: a local rung has a range with peers")
                index = [spec.DTYPES.index(dtype)] + ([] if local else [world_sizes.index(world_size)])
                index.append(spec.OUTPUT_PROFILES.index(profile))
                own += [{"value": f"{{{', '.join(map(str, index))}, {hidden}, {measured[0]}, {measured[1]}, "
                                  f"{{{_shown_limits(limits[rungs])}}}}}",
                         "comment": f"{label} at hidden {hidden}"}
                        for hidden, limits, measured in cell.by_hidden]
                measured = cell.measured or (0, 0)
                entries.append({"value": f"{{{_KEY_CPP[cell.key]}, {measured[0]}, {measured[1]}, "
                                         f"{{{_shown_limits(cell.limits[rungs])}}}}}",
                                "comment": f"{label}: {cell.source}"})
            worlds.append({"label": f"{dtype} ws{world_size}", "entries": entries})
        rows.append({"label": dtype, "worlds": worlds})
    fields = spec.BOUNDARY_FIELDS[rungs]
    sizes = ", ".join(map(str, world_sizes))
    return {
        "name": "Local" if local else "Exchange",
        "what": (f"World size 1, nothing exchanged: the local rungs' boundaries; above them every rung runs "
                 f"{spec.LOCAL_FAMILY} (no peers)" if local else
                 f"World sizes {sizes}: the exchange rungs' boundaries (the local rungs serve no T with peers)"),
        "fields": fields,
        "index": "[dtype][output profile]" if local else "[dtype][world size][output profile]",
        "index_comment": (f"// [dtype: {', '.join(spec.DTYPES)}]" + ("" if local else f"[world size: {sizes}]")
                          + f"[output profile: {', '.join(spec.OUTPUT_PROFILES)}]"),
        "dims": [len(spec.DTYPES)] + ([] if local else [len(world_sizes)]) + [len(spec.OUTPUT_PROFILES)],
        "worlds_nested": not local,
        "rows": rows,
        "own": own,
    }


def _selection_context(table_set: table_sets.TableSet) -> dict:
    match = table_set.match
    return {
        "name": table_set.name,
        "title": table_set.title,
        "match": (f"product {match['product']!r}, compute capability {match['capability']}, interconnect "
                  f"{match['interconnect']}" if match else "any device (the last fallback)"),
        "sources": [_stamp_line(source) for source in table_set.sources],
        "rule": manifest.selection_rule(),
        "all_tokens": tuning.ALL_TOKENS,
        "spaces": [_space_grid(table_set, local=True), _space_grid(table_set, local=False)],
    }


ONE_BLOCK_BOUND = "MOE_AR_ONE_BLOCK_BOUND"  # the macro the local program's one-block kernel is qualified with
STREAMING_BOUND = "MOE_AR_STREAMING_BOUND"  # the macro world size 1's streaming program is qualified with


def register_bound(program: spec.ProgramSpec) -> str:
    """The kernel qualifier that bounds a program's registers (spec.REGISTER_CAP); for world size 1's
    latency program the macro ONE_BLOCK_BOUND, for its streaming program STREAMING_BOUND, which their
    files define (one_block_bound_lines, streaming_bound_lines)."""
    cap = spec.register_cap(program.family, program.world_size, program.profile)
    regime = spec.FAMILY_BY_NAME[program.family].regime
    if cap is None:
        if regime == "local":
            return ONE_BLOCK_BOUND
        return f"__launch_bounds__({abi.MAX_THREADS})"
    # __maxnreg__ and __launch_bounds__ exclude each other; the cap must still let a block of
    # MAX_THREADS threads launch.
    if cap * abi.MAX_THREADS > abi.REGISTERS_PER_SM:
        raise ValueError(f"register cap {cap} for {program.name}: a block of {abi.MAX_THREADS} threads would not fit")
    if regime == "local_streaming":
        return STREAMING_BOUND
    return f"__maxnreg__({cap})"


def one_block_bound_lines() -> str:
    """The definition of ONE_BLOCK_BOUND: MAX_THREADS and the fewest blocks a multiprocessor a shape
    build names (spec.ONE_BLOCK_MIN_BLOCKS_DEFINE), else MAX_THREADS only."""
    define = spec.ONE_BLOCK_MIN_BLOCKS_DEFINE
    return (f"#ifdef {define}\n#define {ONE_BLOCK_BOUND} __launch_bounds__({abi.MAX_THREADS}, {define})\n"
            f"#else\n#define {ONE_BLOCK_BOUND} __launch_bounds__({abi.MAX_THREADS})\n#endif")


def streaming_bound_lines(program: spec.ProgramSpec) -> str:
    """The definition of STREAMING_BOUND: the cap a shape build names (spec.STREAMING_CAP_DEFINE), else
    the program's own (spec.register_cap)."""
    define, cap = spec.STREAMING_CAP_DEFINE, spec.register_cap(program.family, program.world_size, program.profile)
    return (f"#ifdef {define}\n#define {STREAMING_BOUND} __maxnreg__({define})\n"
            f"#else\n#define {STREAMING_BOUND} __maxnreg__({cap})\n#endif")


def cluster_bound() -> str:
    """The cluster kernel's qualifier: MAX_THREADS, spec.LOCAL_MIN_BLOCKS blocks a multiprocessor."""
    return f"__launch_bounds__({abi.MAX_THREADS}, {spec.LOCAL_MIN_BLOCKS})"


def render_all(root: pathlib.Path = REPO_ROOT) -> Result:
    """Every generated file, in memory."""
    root = pathlib.Path(root)
    inputs = inputs_sha256(root)
    env = make_environment(root)
    enumeration = enumerate_programs()
    sets = table_sets.table_sets(root)
    out = Outputs()

    def render(template: str, **context) -> str:
        return env.get_template(template).render(**context)

    # The body: the rendered params.cuh and the hand-written headers, copied as they are.
    body_texts = {PARAMS_FILE: cpp_header(PARAMS_TEMPLATE) + render(
        PARAMS_TEMPLATE,
        params=[{"name": n, "ctype": c, "meaning": m} for n, c, _, m in abi.PARAMS],
        max_world_size=abi.MAX_WORLD_SIZE,
        max_vec_per_thread=abi.MAX_VEC_PER_THREAD,
        max_threads=abi.MAX_THREADS,
        all_loads_max_tokens=abi.ALL_LOADS_MAX_TOKENS,
        enums=abi.shared_enums())}
    body_sources = {PARAMS_FILE: f"templates/{PARAMS_TEMPLATE}"}
    for path in sorted((root / KERNEL_DIR).glob("*.cuh")):
        rel = f"{BODY_DIR}/{path.name}"
        if rel in body_texts:
            raise GenerateError(f"{KERNEL_DIR}/{path.name}: the generator writes {rel} itself")
        body_texts[rel] = path.read_bytes().decode("utf-8")
        body_sources[rel] = f"{KERNEL_DIR}/{path.name}"
    for rel, text in body_texts.items():
        out.add(rel, text)

    def inlined(text: str, origin: str) -> list[str]:
        """The body headers a file includes, in the order they are inlined (manifest_reader.source_for's)."""
        def read(rel: str, including: str) -> str:
            if rel not in body_texts:
                raise GenerateError(f"{body_sources.get(including, including)}: includes "
                                    f"{rel.rsplit('/', 1)[-1]!r}, which is neither in {KERNEL_DIR}/ nor generated")
            return body_texts[rel]
        try:
            return inline_includes(text, origin, BODY_DIR, read)[1]
        except ManifestError as e:
            raise GenerateError(str(e)) from None

    body_name = BODY_ENTRY[len(BODY_DIR) + 1:]
    body_order = inlined(f'#include "{body_name}"\n', "programs/")
    unused = sorted(set(body_texts) - set(body_order))
    if unused:
        raise GenerateError(f"{', '.join(body_sources[rel] for rel in unused)}: included by no program "
                            f"(add it to {KERNEL_DIR}/{body_name} or remove it)")
    # What the compiled code depends on, comments and layout aside: the body's headers in the order
    # they are inlined, and for a program its own text and the headers it includes.
    code_hashes = {BODY_ENTRY: code_sha256(*(body_texts[rel] for rel in body_order))}
    body = {"entry": BODY_ENTRY, "include_dir": BODY_DIR, "headers": body_order, "sources": body_sources}

    for program in enumeration.programs:
        family = spec.FAMILY_BY_NAME[program.family]
        profile = spec.PROFILE_BY_NAME[program.profile]
        bound = register_bound(program)
        text = render(PROGRAM_TEMPLATE,
                      spec=program,
                      name=program.name,
                      symbol=program.symbol,
                      cluster_symbol=program.cluster_symbol,
                      dtype_cpp=spec.DTYPE_CPP[program.dtype],
                      profile_cpp=profile.cpp,
                      regime_cpp=spec.REGIME_BY_NAME[family.regime].cpp,
                      shared_prefetch="true" if family.shared_prefetch else "false",
                      loads=spec.loads_in_flight(program.family, program.profile),
                      row_stages=spec.row_stages(program.family, program.profile),
                      body_file=body_name,
                      register_bound=bound,
                      one_block_bound_lines=one_block_bound_lines() if bound == ONE_BLOCK_BOUND else "",
                      streaming_bound_lines=streaming_bound_lines(program) if bound == STREAMING_BOUND else "",
                      cluster_bound=cluster_bound(),
                      family_meaning=family.meaning,
                      profile_quant="None" if profile.quant is None else f'"{profile.quant}"',
                      profile_meaning=profile.meaning)
        out.add(program.file_name, cpp_header(PROGRAM_TEMPLATE) + text)
        code_hashes[program.name] = code_sha256(text, *(body_texts[rel] for rel in inlined(text, program.file_name)))

    for table_set in sets:
        out.add(table_set.table, cpp_header(SELECTION_TEMPLATE)
                + render(SELECTION_TEMPLATE, **_selection_context(table_set)))
    out.add(SELECTION_MAP_FILE, svg_header(SELECTION_MAP_TEMPLATE)
            + render(SELECTION_MAP_TEMPLATE, **selection_map.context(sets, enumeration)))

    doc = manifest.build(enumeration, sets, out.as_dict(), code_hashes, json_header(inputs), body)
    out.add(MANIFEST_NAME, manifest.dumps(doc))
    return Result(out, enumeration, inputs)


# ---- writing and checking -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WriteReport:
    written: tuple[str, ...]
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]


def _existing_files(dest: pathlib.Path) -> list[str]:
    if not dest.is_dir():
        return []
    return sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() or p.is_symlink())


def _is_generated_tree(dest: pathlib.Path) -> bool:
    """True where dest may be overwritten: absent, empty, or written by us before."""
    if not dest.exists():
        return True
    if not dest.is_dir():
        return False
    if not any(dest.iterdir()):
        return True
    try:
        return b'"_generated"' in (dest / MANIFEST_NAME).read_bytes()
    except OSError:
        return False


def write_tree(outputs: Outputs, dest: pathlib.Path) -> WriteReport:
    """Make dest hold exactly `outputs`: write changed files, remove stale ones."""
    dest = pathlib.Path(dest)
    if not _is_generated_tree(dest):
        raise GenerateError(f"{dest}: not empty and holds no generated {MANIFEST_NAME}; refusing to write there")
    written, unchanged = [], []
    for rel, data in outputs.items():
        path = dest / rel
        try:
            if path.read_bytes() == data:
                unchanged.append(rel)
                continue
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        written.append(rel)
    removed = [rel for rel in _existing_files(dest) if rel not in outputs]
    for rel in removed:
        (dest / rel).unlink()
    for d in sorted((p for p in dest.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return WriteReport(tuple(written), tuple(unchanged), tuple(removed))


def compare_tree(outputs: Outputs, dest: pathlib.Path, label: str = "generated") -> list[str]:
    """Unified diffs (one string per differing file) between dest and `outputs`."""
    dest = pathlib.Path(dest)
    diffs = []
    names = sorted(set(_existing_files(dest)) | {rel for rel, _ in outputs.items()})
    for rel in names:
        old = (dest / rel).read_bytes() if (dest / rel).is_file() else None
        new = outputs[rel] if rel in outputs else None
        if old == new:
            continue
        if new is None:
            diffs.append(f"--- {label}/{rel}\n+++ /dev/null\n(no longer generated: `gen-programs` removes it)\n")
            continue
        if old is None:
            diffs.append(f"--- /dev/null\n+++ {label}/{rel} (regenerated)\n(missing: `gen-programs` writes it)\n")
            continue
        diff = "".join(difflib.unified_diff(
            old.decode("utf-8", "replace").splitlines(keepends=True),
            new.decode("utf-8", "replace").splitlines(keepends=True),
            fromfile=f"{label}/{rel}", tofile=f"{label}/{rel} (regenerated)"))
        if not diff:  # same text lines, different bytes (line endings, trailing newline)
            diff = f"--- {label}/{rel}\n+++ {label}/{rel} (regenerated)\n(bytes differ)\n"
        diffs.append(diff if diff.endswith("\n") else diff + "\n")
    return diffs


def check_tree(outputs: Outputs, dest: pathlib.Path) -> list[str]:
    """The --check gate: write outputs into a temporary folder, compare with dest."""
    with tempfile.TemporaryDirectory(prefix="gen-programs-check-") as tmp:
        write_tree(outputs, pathlib.Path(tmp))
        rendered = Outputs()
        for rel in _existing_files(pathlib.Path(tmp)):
            rendered.add(rel, (pathlib.Path(tmp) / rel).read_bytes())
    return compare_tree(rendered, dest)


__all__ = ["REPO_ROOT", "GenerateError", "Outputs", "Result", "WriteReport", "render_all", "write_tree", "compare_tree",
           "check_tree", "inputs_sha256", "input_files", "REGENERATE"]
