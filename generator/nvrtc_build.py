"""`gen-programs compile`: compile generated programs with NVRTC, no GPU needed.

Uses CuPy's low-level NVRTC bindings (`cupy.cuda.nvrtc`), which only load
libnvrtc; CuPy's higher-level compile helpers query the driver and fail on a
machine without a GPU. CuPy is imported by `compile_programs` only (its NVRTC
version picks the headers, moe_ar_common/cuda_env.py), so the rest of the generator never
imports it.

Each (program, arch) is one job in a process pool. The ptxas `-v` log gives
registers, spill stores/loads and stack frame per entry function.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import time

from moe_ar_common import cuda_env, manifest_reader


def options(arch: str, include_dir: str, compile_options) -> list[str]:
    return [f"--gpu-architecture={arch}", *compile_options, f"-I{include_dir}", "-Xptxas=-v"]


@dataclasses.dataclass(frozen=True)
class EntryStats:
    function: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@dataclasses.dataclass(frozen=True)
class CompileResult:
    program: str
    arch: str
    ok: bool
    log: str
    seconds: float
    cubin_bytes: int
    entries: tuple[EntryStats, ...]


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas_log(log: str) -> tuple[EntryStats, ...]:
    """Per entry function: registers, stack frame and spills, from a ptxas -v log."""
    entries, current = [], None

    def flush():
        if current is not None:
            entries.append(EntryStats(current["name"], current.get("regs", -1), current.get("stack", 0),
                                      current.get("st", 0), current.get("ld", 0)))

    for line in log.splitlines():
        match = _ENTRY_RE.search(line)
        if match:
            flush()
            current = {"name": match.group(1)}
            continue
        if current is None:
            continue
        match = _FRAME_RE.search(line)
        if match and "stack" not in current:
            current["stack"], current["st"], current["ld"] = (int(g) for g in match.groups())
        match = _REGS_RE.search(line)
        if match and "regs" not in current:
            current["regs"] = int(match.group(1))
    flush()
    return tuple(entries)


def compile_one(program: str, arch: str, source: str, opts: list[str]) -> CompileResult:
    """One NVRTC compile to cubin; runs in a worker process."""
    from cupy.cuda import nvrtc

    start = time.perf_counter()
    prog = nvrtc.createProgram(source, f"{program}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
        if isinstance(log, bytes):
            log = log.decode("utf-8", "replace")
        log = log.rstrip("\x00")
        cubin = nvrtc.getCUBIN(prog) if ok else b""
    finally:
        nvrtc.destroyProgram(prog)
    return CompileResult(program, arch, ok, log, time.perf_counter() - start, len(cubin),
                         parse_ptxas_log(log) if ok else ())


# A few spilled bytes are ptxas's own choice and cost less than the occupancy more registers would
# lose; more than this many is a kernel change that went wrong, and fails the gate.
SPILL_BUDGET_BYTES = 64
# A program compiled under a register cap (spec.REGISTER_CAP) spills by design: the cap was chosen
# because it measured faster with the spills than without the cap. Its budget is wider, still a gate.
CAPPED_SPILL_BUDGET_BYTES = 256


def spill_budget(register_cap: int | None) -> int:
    return SPILL_BUDGET_BYTES if register_cap is None else CAPPED_SPILL_BUDGET_BYTES


def warnings(result: CompileResult, budget: int = SPILL_BUDGET_BYTES) -> list[str]:
    """Compiler warnings and spills within the budget (they do not fail the gate)."""
    out = [line for line in result.log.splitlines() if "warning" in line.lower()]
    for e in result.entries:
        if 0 < max(e.spill_store_bytes, e.spill_load_bytes) <= budget:
            out.append(f"{e.function}: spills {e.spill_store_bytes} bytes stores, {e.spill_load_bytes} bytes loads "
                       f"(within the {budget}-byte budget)")
    return out


def problems(result: CompileResult, symbol: str, budget: int = SPILL_BUDGET_BYTES) -> list[str]:
    """Why this result fails the gate (empty when it passes)."""
    if not result.ok:
        return ["NVRTC error"]
    out = []
    if symbol not in {e.function for e in result.entries}:
        found = ", ".join(e.function for e in result.entries) or "none"
        out.append(f"kernel symbol {symbol!r} is not an entry function of the cubin (found: {found}); "
                   f"the program must define it extern \"C\"")
    for e in result.entries:
        if max(e.spill_store_bytes, e.spill_load_bytes) > budget:
            out.append(f"{e.function}: spills {e.spill_store_bytes} bytes stores, {e.spill_load_bytes} bytes loads "
                       f"(over the {budget}-byte budget)")
    return out


def compile_programs(generated_dir: pathlib.Path, programs: list[str], archs: list[str], jobs: int,
                     progress=None) -> list[CompileResult]:
    """Verify the manifest, then compile every (program, arch); results in job order.
    cuda_env.MissingToolchain when NVRTC or its headers are not installed."""
    import concurrent.futures
    import multiprocessing

    manifest = manifest_reader.load_verified_manifest(generated_dir)
    _nvrtc, version = cuda_env.load_nvrtc()  # raises cuda_env.MissingToolchain naming the extra
    include_dir = cuda_env.include_dir(version[0])
    sources = {name: manifest_reader.source_for(manifest, generated_dir, name) for name in programs}
    work = [(name, arch) for name in programs for arch in archs]
    results = {}
    # spawn: workers start clean (no inherited CUDA or driver state).
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        futures = {pool.submit(compile_one, name, arch, sources[name],
                               options(arch, include_dir, manifest["compile_options"])): (name, arch)
                   for name, arch in work}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
            if progress is not None:
                progress(futures[future])
    return [results[key] for key in work]
