"""The committed programs: manifest, selection, compilation and the compile cache.

Reads only generated/ (verified against its manifest first). Programs are
compiled with NVRTC through CuPy's low-level bindings at first use, for the
GPU's own target (sm_90a on H100/H200, sm_100a on B200), and kept in a disk
cache keyed by a sha256 of everything compiled: the self-contained source text
(body headers inlined), the options, the target and the NVRTC version. A cache entry
carries its own checksum (bound to its key); a corrupt entry is recompiled,
never loaded. Only a directory the user owns and nobody else can write is used
(created 0700); entries are written 0600 through a fresh temporary file and an
atomic rename, and opened without following symlinks. Anything else, and any
OSError, is a miss: the cubin is compiled and kept in memory for the process.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import importlib.resources
import os
import pathlib
import stat
import tempfile
import threading
import time
import warnings

from moe_ar_common import cuda_env
from moe_ar_common import manifest_reader as _manifest


def _generated_dir() -> pathlib.Path:
    """The programs beside this code: a source checkout's generated/ (an editable install's too),
    else an installed wheel's package data, moe_ar_data/generated (pyproject.toml). The checkout
    comes first, so code run from a checkout never pairs with another installation's programs."""
    checkout = pathlib.Path(__file__).resolve().parent.parent / "generated"
    if (checkout / _manifest.MANIFEST_NAME).is_file():
        return checkout
    try:
        installed = importlib.resources.files("moe_ar_data") / "generated"
    except ModuleNotFoundError:
        return checkout  # neither: program_set() reports the missing manifest
    # A wheel installed by pip is a folder on disk (a zipped import is not supported).
    return installed if isinstance(installed, pathlib.Path) else checkout


GENERATED_DIR = _generated_dir()

TARGET_FOR_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


class _ProgramSet:
    """The verified manifest and lookups derived from it (built once per process)."""

    def __init__(self, generated_dir: pathlib.Path):
        self.dir = generated_dir
        self.manifest = _manifest.load_verified_manifest(generated_dir)
        self.by_name = {p["name"]: p for p in self.manifest["programs"]}
        # (family, dtype, world_size, profile) -> program name; holes are absent.
        self.cells = {(p["family"], p["dtype"], p["world_size"], p["profile"]): p["name"]
                      for p in self.manifest["programs"]}
        self.params = [tuple(x) for x in self.manifest["param_plan"]]
        self.limits = self.manifest["limits"]
        # the words and bits the kernels share with the runtime: enum -> {C++ name: value}, and meanings
        self.constants = {e["name"]: {x["name"]: x["value"] for x in e["entries"]} for e in self.manifest["constants"]}
        self.constant_meanings = {e["name"]: {x["value"]: x["meaning"] for x in e["entries"]}
                                  for e in self.manifest["constants"]}
        selection = self.manifest["selection"]
        # The regime ladder: (regime, the boundary field that ends its range, or None for the last).
        self.ladder = [tuple(rung) for rung in selection["ladder"]]
        # A boundary of this value bounds nothing: its regime runs every larger T.
        self.all_tokens = selection["all_tokens"]
        families = self.manifest["axes"]["families"]
        # (regime, shared_prefetch) -> family
        self.family_of = {(f["regime"], f["shared_prefetch"]): f["name"] for f in families}
        # (family, dtype, world_size, profile) of a hole -> the family that runs there instead (the
        # manifest's holes: the base chain, within the family's world sizes)
        self.hole_fallback = {(h["family"], h["dtype"], h["world_size"], h["profile"]): h["fallback_family"]
                              for h in self.manifest["holes"]}
        # each family's world sizes, and the family every exchange rung runs at the world size without peers
        self.world_sizes = {f["name"]: tuple(f["world_sizes"]) for f in families}
        self.no_peers = (selection["no_peers"]["world_size"], selection["no_peers"]["family"])
        # quant argument -> output profile
        self.profile_of_quant = {p["quant"]: p["name"] for p in self.manifest["axes"]["output_profiles"]}


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def program_set() -> _ProgramSet:
    return _ProgramSet(GENERATED_DIR)


def programs() -> list[str]:
    """Names of every generated program."""
    return sorted(program_set().by_name)


def program_info(name: str) -> dict:
    """The manifest entry of a program (family, dtype, world_size, profile, protocol_class, file, ...).
    Raises ValueError for an unknown name."""
    try:
        return dict(program_set().by_name[name])
    except KeyError:
        raise ValueError(f"program: no program named {name!r} (see dispatch.programs())") from None


# ---- the kernel argument --------------------------------------------------------------

_CTYPES = {"c_void_p": ctypes.c_void_p, "c_int64": ctypes.c_int64, "c_uint64": ctypes.c_uint64,
           "c_int32": ctypes.c_int32, "c_float": ctypes.c_float}


def _ctype(name: str):
    """A ctypes type from the manifest's plan: a scalar name, or "name*N" for an array of N."""
    scalar, _, count = name.partition("*")
    return _CTYPES[scalar] * int(count) if count else _CTYPES[scalar]


@functools.lru_cache(maxsize=None)
def params_struct() -> type:
    """A ctypes Structure laid out like the C++ `moe_ar::Params` (from the manifest's plan)."""
    fields = [(name, _ctype(ct)) for name, _cpp, ct in program_set().params]
    return type("Params", (ctypes.Structure,), {"_fields_": fields})


# ---- selection --------------------------------------------------------------------------

# The regimes the runtime treats apart, by their manifest names (generator/spec.py; the manifest's
# ladder must list them, test_abi_constants_cpu.py): the one whose range a workspace's one-shot buffer
# caps (its oneshot_max_tokens), and world size 1's latency and streaming layouts.
ONESHOT_REGIME = "oneshot"
LOCAL_LATENCY_REGIME = "local"
LOCAL_STREAMING_REGIME = "local_streaming"
LOCAL_LATENCY_FIELD = "local_max_tokens"  # the boundary that ends the latency layout's range


def select_family(dtype: str, world_size: int, profile: str, tokens: int, has_shared: bool,
                  oneshot_capacity: int, *, bounds: dict) -> str:
    """The family for a call: the first regime of the manifest's ladder whose boundary in `bounds`
    ({field: tokens}: the workspace's, dispatch/table_sets.py) T does not exceed, then its
    shared-expert variant.

    The token regime is chosen from T (the same on every rank); the shared-expert
    variant from a rank-local fact, so it must stay within the protocol class of
    the regime's base family, which it does by construction (generator/spec.py).
    A workspace built with a smaller one-shot buffer than the table's boundary caps
    the one-shot range.
    """
    generated = program_set()
    tokens = max(tokens, 1)  # 0 tokens launch nothing; name what 1 token runs (no rung serves T = 0 alone)
    for regime, max_tokens_field in generated.ladder:
        if max_tokens_field is None:
            break
        max_tokens = bounds[max_tokens_field]
        if regime == ONESHOT_REGIME:
            max_tokens = min(max_tokens, oneshot_capacity)
        if tokens <= max_tokens:
            break
    shared = generated.family_of.get((regime, True))
    if has_shared and shared is not None and (shared, dtype, world_size, profile) in generated.cells:
        return shared
    return generated.family_of[(regime, False)]


def program_for(family: str, dtype: str, world_size: int, profile: str) -> str:
    """The program of a cell, falling back explicitly from a hole to the family the manifest names for it
    (the tables' `hole -> family`), and at world size 1 from an exchange family to the local one
    (the manifest's selection.no_peers)."""
    generated = program_set()
    tried = []
    while True:
        name = generated.cells.get((family, dtype, world_size, profile))
        if name is not None:
            return name
        tried.append(family)
        fallback = generated.hole_fallback.get((family, dtype, world_size, profile))
        no_peers, local = generated.no_peers
        if fallback is None and world_size == no_peers and world_size not in generated.world_sizes.get(family, ()):
            fallback = local
        if fallback is None or fallback in tried:
            raise ValueError(f"program: no program for {dtype} world size {world_size} output profile {profile} "
                             f"(tried families {tried})")
        family = fallback


# ---- compilation ----------------------------------------------------------------------

def cache_dir() -> pathlib.Path:
    """$MOE_AR_CACHE_DIR, default $XDG_CACHE_HOME/moe_ar or ~/.cache/moe_ar (used only when trusted)."""
    d = os.environ.get("MOE_AR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moe_ar")
    return pathlib.Path(d)


# Cubins the disk cache could not hold (directory refused, an OSError reading or writing the
# entry), by cache key: a second load in the same process does not compile again.
_memory_cubins: dict[str, bytes] = {}
_warned_dirs: set[str] = set()  # refused directories already warned about in this process
_cache_lock = threading.Lock()  # not _lock: load() holds that one while it compiles


def _distrust(st: os.stat_result, kind: str) -> str | None:
    """Why a cache directory or entry is not trusted, None when it is: anyone but this user able
    to write it could plant a cubin (its checksum is recomputable)."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not (stat.S_ISDIR if kind == "directory" else stat.S_ISREG)(st.st_mode):
        return f"it is not a {kind}"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _trusted_cache_dir() -> pathlib.Path | None:
    """The cache directory, created 0700 when missing; None when it is not trusted (warned once
    per directory and process)."""
    d = cache_dir()
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        why = _distrust(os.lstat(d), "directory")  # the leaf itself: a symlink is refused
    except OSError as e:
        why = f"it cannot be created or read ({e})"
    if why is None:
        return d
    with _cache_lock:
        first = str(d) not in _warned_dirs
        _warned_dirs.add(str(d))
    if first:
        warnings.warn(f"moe_ar compile cache: not using {d}: {why}; programs are compiled and kept in memory "
                      f"in this process (use a directory only you can write: chmod 700 it if it is yours, "
                      f"or set MOE_AR_CACHE_DIR)", RuntimeWarning, stacklevel=3)
    return None


def _entry_digest(key: str, cubin: bytes) -> bytes:
    """The checksum heading an entry; it covers the key, so an entry copied to another name is refused."""
    return hashlib.sha256(key.encode() + b"\0" + cubin).hexdigest().encode()


def _read_entry(path: pathlib.Path) -> tuple[bytes | None, str | None]:
    """(the entry's bytes, None), or (None, why it is refused). Never follows a symlink (O_NOFOLLOW);
    O_NONBLOCK so that a FIFO cannot block the open. Raises OSError (FileNotFoundError: no entry)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "it is a symlink"
        raise
    try:
        why = _distrust(os.fstat(fd), "regular file")  # the file opened, not the name
        if why is not None:
            return None, why
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(), None
    finally:
        os.close(fd)


def _write_entry(d: pathlib.Path, path: pathlib.Path, blob: bytes) -> None:
    """Atomically: a fresh 0600 temporary file of an unpredictable name in `d`, renamed over `path`
    (which replaces a symlink there, never writes through it). Raises OSError."""
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def compile_cubin(source: str, name: str, target: str) -> tuple[bytes, str]:
    """NVRTC: source -> cubin for `target`; returns (cubin, ptxas log). Raises on error."""
    nvrtc, version = cuda_env.load_nvrtc()  # cuda_env.MissingToolchain names the extra to install
    options = [f"--gpu-architecture={target}", *program_set().manifest["compile_options"], "-Xptxas=-v",
               f"-I{cuda_env.include_dir(version[0])}"]
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed to compile {name} for {target}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _cache_key(source: str, target: str) -> str:
    nvrtc, _version = cuda_env.load_nvrtc()
    h = hashlib.sha256()
    options = " ".join(program_set().manifest["compile_options"])
    for part in (source, target, options, str(nvrtc.getVersion())):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cached_cubin(name: str, target: str, prefix: str = "") -> tuple[bytes, dict]:
    """The program's cubin, from the disk cache, from memory or freshly compiled. Returns (cubin, info);
    info["source"] is "cache", "memory" or "compiled". `prefix`: lines put before the program's source
    (shape_constants.defines), part of what the cache key hashes."""
    ps = program_set()
    source = prefix + _manifest.source_for(ps.manifest, ps.dir, name)  # re-verifies every file it inlines
    key = _cache_key(source, target)
    path = cache_dir() / f"{name}-{target}-{key[:32]}.cubin"
    info = {"program": name, "target": target, "cache": str(path)}
    t0 = time.perf_counter()
    cubin = _memory_cubins.get(key)
    if cubin is not None:
        info.update(source="memory", seconds=time.perf_counter() - t0)
        return cubin, info
    d = _trusted_cache_dir()
    keep = d is None  # in memory as well when the disk cannot give it back
    if d is None:
        info["cache_refused"] = "the directory is not trusted (see the warning)"
    else:
        try:
            blob, why = _read_entry(path)
        except FileNotFoundError:
            blob, why = None, None
        except OSError as e:
            blob, why, keep = None, None, True
            info["cache_error"] = f"read: {e}"
        if why is not None:
            info["cache_refused"] = why  # compiled and replaced below
        if blob is not None:
            digest, cubin = blob[:64], blob[64:]
            if digest == _entry_digest(key, cubin):
                info.update(source="cache", seconds=time.perf_counter() - t0)
                return cubin, info
            info["cache_corrupt"] = True  # fall through: recompile and overwrite
    cubin, log = compile_cubin(source, name, target)
    if d is not None:
        try:
            _write_entry(d, path, _entry_digest(key, cubin) + cubin)
        except OSError as e:
            keep = True
            info["cache_error"] = f"write: {e}"
    if keep:
        _memory_cubins[key] = cubin
    info.update(source="compiled", seconds=time.perf_counter() - t0, ptxas=log)
    return cubin, info


class LoadedProgram:
    """A program's kernel loaded on one device."""

    def __init__(self, name: str, device_index: int, prefix: str = ""):
        cuda_env.load_nvrtc()  # without the cu12 / cu13 extra: an error naming it, not a bare ImportError
        import cupy
        from cupy.cuda import function
        self.name = name
        self.entry = program_set().by_name[name]
        with cupy.cuda.Device(device_index):
            cc = cupy.cuda.Device(device_index).compute_capability  # e.g. "90"
            capability = (int(cc[:-1]), int(cc[-1]))
            target = TARGET_FOR_CAPABILITY.get(capability)
            if target is None:
                raise ValueError(f"device: compute capability {capability} is not a target of these programs "
                                 f"({sorted(TARGET_FOR_CAPABILITY.values())})")
            cubin, self.load_info = cached_cubin(name, target, prefix)
            self.module = function.Module()
            self.module.load(cubin)
            self.function = self.module.get_function(self.entry["symbol"])
            self.function_ptr = int(self.function.ptr)
            _load_now(self.function_ptr)
            # world size 1's latency programs: their cluster layout, a second kernel (0: none)
            self.cluster_function_ptr = 0
            if self.entry.get("cluster_symbol"):
                self.cluster_function = self.module.get_function(self.entry["cluster_symbol"])
                self.cluster_function_ptr = int(self.cluster_function.ptr)
                _load_now(self.cluster_function_ptr)
            if self.entry["row_stages"]:  # the row ring: above the 48 KiB a launch may take unasked
                self._allow_dynamic_smem(dynamic_smem_bytes(self.entry, program_set().limits["max_hidden"], 2))
        self.device_index = device_index

    def _allow_dynamic_smem(self, nbytes: int) -> None:
        from cuda.bindings import driver as cu
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        err, = cu.cuFuncSetAttribute(cu.CUfunction(self.function_ptr), attr, nbytes)
        _check(err, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def prefer_largest_shared_memory(self) -> None:
        """Ask for the largest shared-memory carveout of the SM at every launch (ranks sharing a GPU:
        see _Launcher in launcher.py). A hint to the driver; no effect on what the kernel computes."""
        from cuda.bindings import driver as cu
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        err, = cu.cuFuncSetAttribute(cu.CUfunction(self.function_ptr), attr, 100)  # percent of the maximum
        _check(err, "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)")

    def max_blocks_per_sm(self, threads: int, dynamic_smem: int = 0) -> int:
        from cuda.bindings import driver as cu
        err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(self.function_ptr), threads,
                                                                 dynamic_smem)
        _check(err, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return int(n)


def dynamic_smem_bytes(entry: dict, hidden: int, elem_bytes: int) -> int:
    """Dynamic shared memory of a launch of the program (manifest launch.dynamic_smem): the row
    ring's rows of `hidden` elements and 128 bytes for its barriers; 0 without a ring."""
    stages = entry["row_stages"]
    return stages * hidden * elem_bytes + 128 if stages else 0


def _load_now(function_ptr: int) -> None:
    """Put the kernel's code on the device now. With CUDA's lazy loading (the default) that would
    happen at its first launch and may wait for the kernels already running in the context; when
    those kernels are the other ranks of an emulated world, spinning until this rank's kernel
    arrives, that wait is a deadlock (seen: a 10 s timeout at the first launch of a program)."""
    from cuda.bindings import driver as cu
    load = getattr(cu, "cuFuncLoad", None)  # CUDA 12.4+
    if load is not None:
        err, = load(cu.CUfunction(function_ptr))
        _check(err, "cuFuncLoad")


_loaded: dict[tuple[str, int, str], LoadedProgram] = {}


def load(name: str, device_index: int, prefix: str = "") -> LoadedProgram:
    """The program loaded on a device, once a process; `prefix`: as cached_cubin's (a build of its own)."""
    key = (name, device_index, prefix)
    prog = _loaded.get(key)
    if prog is None:
        with _lock:
            prog = _loaded.get(key)
            if prog is None:
                prog = _loaded[key] = LoadedProgram(name, device_index, prefix)
    return prog


def warmup(names=None, device_index: int | None = None) -> list[dict]:
    """Compile (or load from the cache) the named programs ahead of time and put their code on the
    device; returns per-program info with the seconds each took and whether it came from the cache."""
    import torch
    if isinstance(names, (str, bytes)):
        raise ValueError(f"names: a list of program names, not one string ({names!r}); pass [{names!r}]")
    if torch.cuda.device_count() == 0:
        raise ValueError("device_index: no CUDA GPU is visible (torch.cuda.device_count() is 0); warmup "
                         "loads the programs onto one")
    if device_index is None:
        device_index = torch.cuda.current_device()
    out = []
    for name in (programs() if names is None else names):
        program_info(name)
        t0 = time.perf_counter()
        prog = load(name, device_index)
        info = {k: v for k, v in prog.load_info.items() if k != "ptxas"}
        info["total_seconds"] = time.perf_counter() - t0
        out.append(info)
    return out


def _check(err, what: str) -> None:
    code = int(err) if not isinstance(err, tuple) else int(err[0])
    if code != 0:
        raise RuntimeError(f"{what} failed: CUDA error {err}")
