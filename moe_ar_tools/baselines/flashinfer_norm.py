"""FlashInfer's CUDA norm kernels (fused_add_rmsnorm, fused_add_rmsnorm_quant to FP8) for the
world-size-1 benchmark's `flashinfer` system, without FlashInfer's Python package.

The GPU machine has no FlashInfer and reaches no registry; flashinfer-python's wheel pulls in
apache-tvm-ffi, nvidia-cutlass-dsl and nvidia-cudnn-frontend and recent releases are ~100 MB. What
travels instead is the part the kernels need: fetch_flashinfer.sh (on a machine that reaches PyPI)
downloads the wheel of PINNED_VERSION and runs `extract`, which writes into .baselines/flashinfer/
the include closure of flashinfer/norm.cuh (about 200 KB), empty stand-ins for three headers that
closure includes but never uses, and VERSION.json; where nvcc is at hand it also runs `build`
(flashinfer_norm.cu, our C entry points around FlashInfer's kernel templates, into a shared library
for sm_90 and sm_100). On the GPU machine `load` takes that library, or builds it there with nvcc
(about 20 s), or says why it cannot: the bench then records `flashinfer` as null with that reason.

Why 0.6.5: its fused_add_rmsnorm and fused_add_rmsnorm_quant run these CUDA kernels by default;
later releases default to CuTe-DSL kernels (nvidia-cutlass-dsl: its CUDA 13 library wheel alone is
92 MB, over what can travel) and keep the CUDA ones as their fallback. Another version can be
fetched (`fetch_flashinfer.sh VERSION`; 0.7.4 extracts and builds too): the include closure is
computed, and the FP8 kernel's scale argument (a float in 0.6.5, a device pointer in 0.7.4) is read
from its header.

    python -m moe_ar_tools.baselines.flashinfer_norm extract WHEEL DEST
    python -m moe_ar_tools.baselines.flashinfer_norm build DEST [--arch sm_90 --arch sm_100]
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile
from typing import Optional

from moe_ar_tools.provenance import REPO_ROOT

PINNED_VERSION = "0.6.5"
DEFAULT_DIR = REPO_ROOT / ".baselines" / "flashinfer"
WHEEL_INCLUDE = "flashinfer/data/include/"   # where the wheel keeps FlashInfer's headers
NORM_HEADER = "flashinfer/norm.cuh"
# Included by norm.cuh's TRT-LLM helpers (cudaUtils.h, reduceKernelUtils.cuh) and used by none of the
# norm kernels; the GPU machine's nvcc may lack cuBLAS / cuRAND headers. Empty files searched after
# every other include folder stand in for them only where the real ones are missing.
UNUSED_HEADERS = ("cublasLt.h", "cublas_v2.h", "curand_kernel.h")
SOURCE = pathlib.Path(__file__).with_name("flashinfer_norm.cu")
LIBRARY = "libmoe_ar_flashinfer_norm.so"
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-DENABLE_BF16", "-DENABLE_FP8")
DEFAULT_ARCHES = ("sm_90", "sm_100")
DTYPE_CODES = {"torch.bfloat16": 0, "torch.float16": 1}


class Unavailable(RuntimeError):
    """FlashInfer's kernels cannot run here; the message says why."""


def unsupported(quant: Optional[str], capability: tuple) -> Optional[str]:
    """Why FlashInfer has no fused add + RMSNorm kernel for the output `quant` (dispatch's quant=) on a
    GPU of compute `capability`, or None when it has one."""
    if quant in (None, "fp8_tensor"):
        return None
    if quant == "fp8_group128":
        return ("FlashInfer has no fused add + RMSNorm with per-token-group FP8 scales: its FP8 norm kernel "
                "(fused_add_rmsnorm_quant) takes one per-tensor scale")
    if quant == "nvfp4":
        if tuple(capability) < (10, 0):
            return ("FlashInfer's NVFP4 norm kernels (rmsnorm_fp4quant, add_rmsnorm_fp4quant, CuTe DSL) are sm_100+ "
                    "only: they convert with cvt.rn.satfinite.e2m1x2.f32, which sm_90 lacks")
        return "FlashInfer's NVFP4 norm kernels are CuTe-DSL kernels (nvidia-cutlass-dsl), which do not travel here"
    raise ValueError(f"quant: {quant!r}, expected None, 'nvfp4', 'fp8_group128' or 'fp8_tensor'")


# ---- extraction (no GPU, no torch) -------------------------------------------------------------

_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


def include_closure(files: dict, start: str = NORM_HEADER) -> list:
    """The headers of `files` ({path under the include folder: text}) that `start` includes,
    directly or not: a quoted name is looked up beside the including file, then at the top; an
    angle-bracket name at the top only; names not in `files` (CUDA's, the C++ library's) are left
    to the compiler. Sorted paths; KeyError when `start` is missing."""
    if start not in files:
        raise KeyError(f"{start} is not in the headers given")
    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        folder = pathlib.PurePosixPath(path).parent
        for name in _INCLUDE.findall(files[path]):
            beside = _normalize(folder / name)
            for candidate in (beside, _normalize(pathlib.PurePosixPath(name))):
                if candidate in files:
                    todo.append(candidate)
                    break
    return sorted(seen)


def _normalize(path: pathlib.PurePosixPath) -> str:
    parts = []
    for part in path.parts:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def scale_on_device(norm_header: str) -> bool:
    """True when FusedAddRMSNormQuant reads its FP8 scale from a device pointer (0.7.4), False when
    it takes a float (0.6.5)."""
    m = re.search(r"cudaError_t\s+FusedAddRMSNormQuant\s*\(([^)]*)\)", norm_header)
    if m is None:
        raise ValueError("norm.cuh declares no FusedAddRMSNormQuant (FlashInfer 0.6.0 or later has it)")
    return re.search(r"float\s*\*\s*scale\b", m.group(1)) is not None


def extract(wheel: pathlib.Path, dest: pathlib.Path) -> dict:
    """Write the include closure of flashinfer/norm.cuh from flashinfer-python's `wheel` into
    dest/include, the stand-ins for UNUSED_HEADERS into dest/shim, and dest/VERSION.json (the
    release, the wheel's sha256, the files, the FP8 scale convention). Replaces what was there."""
    wheel, dest = pathlib.Path(wheel), pathlib.Path(dest)
    with zipfile.ZipFile(wheel) as z:
        headers = {n[len(WHEEL_INCLUDE):]: z.read(n).decode("utf-8", "replace") for n in z.namelist()
                   if n.startswith(WHEEL_INCLUDE) and not n.endswith("/")}
        metadata = next((z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA")), "")
    if not headers:
        raise ValueError(f"wheel: {wheel.name} has no {WHEEL_INCLUDE} (FlashInfer wheels since 0.5 ship their headers there)")
    files = include_closure(headers)
    version = re.search(r"^Version:\s*(\S+)", metadata, re.M)
    for sub in ("include", "shim", "build"):
        shutil.rmtree(dest / sub, ignore_errors=True)
    for rel in files:
        path = dest / "include" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(headers[rel])
    (dest / "shim").mkdir(parents=True)
    for name in UNUSED_HEADERS:
        (dest / "shim" / name).write_text("// empty: included by FlashInfer's TRT-LLM helpers, unused by its norm kernels\n")
    info = {"package": "flashinfer-python", "version": version.group(1) if version else None, "wheel": wheel.name,
            "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(), "header": NORM_HEADER, "files": files,
            "scale_on_device": scale_on_device(headers[NORM_HEADER]), "library": None}
    (dest / "VERSION.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def read_info(dest: pathlib.Path) -> dict:
    """dest/VERSION.json; Unavailable (saying how to make it) when it is missing."""
    path = pathlib.Path(dest) / "VERSION.json"
    if not path.is_file():
        raise Unavailable(f"FlashInfer's norm kernels not fetched: no {path} (run moe_ar_tools/baselines/"
                          f"fetch_flashinfer.sh where PyPI is reachable, and carry .baselines to the GPU machine)")
    return json.loads(path.read_text())


# ---- the library -------------------------------------------------------------------------------

def source_key(dest: pathlib.Path, info: dict, arches) -> str:
    """What a built library depends on: our entry points, the headers, the flags and targets."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for rel in info["files"]:
        h.update(rel.encode() + b"\0" + (pathlib.Path(dest) / "include" / rel).read_bytes())
    h.update(repr((NVCC_FLAGS, info["scale_on_device"], sorted(arches))).encode())
    return h.hexdigest()[:16]


def find_nvcc() -> Optional[str]:
    """$CUDA_HOME/bin/nvcc, else nvcc on PATH, else /usr/local/cuda/bin/nvcc; None when none runs."""
    cuda_home = os.environ.get("CUDA_HOME")
    for candidate in (cuda_home and os.path.join(cuda_home, "bin", "nvcc"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_command(nvcc: str, dest: pathlib.Path, info: dict, arches, out: pathlib.Path) -> list:
    dest = pathlib.Path(dest)
    cmd = [nvcc, *NVCC_FLAGS, "-I", str(dest / "include"), "-Xcompiler", f"-idirafter,{dest / 'shim'}"]
    if info["scale_on_device"]:
        cmd.append("-DMOE_AR_FI_SCALE_ON_DEVICE")
    for arch in arches:
        cmd += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
    return cmd + ["-o", str(out), str(SOURCE)]


def build(dest: pathlib.Path, arches=DEFAULT_ARCHES, nvcc: Optional[str] = None) -> pathlib.Path:
    """Compile flashinfer_norm.cu against the extracted headers into dest/build/<key>/LIBRARY (kept:
    a second build of the same sources and targets is free). Unavailable when nvcc is missing or fails."""
    dest = pathlib.Path(dest)
    info = read_info(dest)
    out = dest / "build" / source_key(dest, info, arches) / LIBRARY
    if out.is_file():
        return out
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise Unavailable("no nvcc to build FlashInfer's norm kernels (looked at $CUDA_HOME/bin, PATH, /usr/local/cuda/bin)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.so")
    proc = subprocess.run(nvcc_command(nvcc, dest, info, arches, tmp), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise Unavailable(f"nvcc failed on FlashInfer's norm kernels: {(proc.stderr or proc.stdout)[-1500:]}")
    os.replace(tmp, out)
    return out


def record_prebuilt(dest: pathlib.Path, library: pathlib.Path, arches) -> None:
    """Note a library built here in VERSION.json, so that the GPU machine takes it as it is."""
    path = pathlib.Path(dest) / "VERSION.json"
    info = json.loads(path.read_text())
    info["library"] = {"path": str(pathlib.Path(library).relative_to(dest)), "arches": list(arches),
                       "key": source_key(dest, info, arches)}
    path.write_text(json.dumps(info, indent=1) + "\n")


class FlashInferNorm:
    """The entry points of a loaded library, launched on torch's current stream (capturable)."""

    def __init__(self, library: pathlib.Path, info: dict):
        self.path, self.info = pathlib.Path(library), info
        self.lib = ctypes.CDLL(str(library))
        p, u, i, f = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_float
        self.lib.moe_ar_fi_fused_add_rmsnorm.argtypes = (p, p, p, u, u, i, f, i, p)
        self.lib.moe_ar_fi_fused_add_rmsnorm.restype = i
        self.lib.moe_ar_fi_fused_add_rmsnorm_fp8.argtypes = (p, p, p, p, u, u, i, f, p, f, i, p)
        self.lib.moe_ar_fi_fused_add_rmsnorm_fp8.restype = i
        self.lib.moe_ar_fi_error_string.argtypes = (i,)
        self.lib.moe_ar_fi_error_string.restype = ctypes.c_char_p

    @staticmethod
    def _check(input, residual, weight):
        T, H = input.shape
        if str(input.dtype) not in DTYPE_CODES:
            raise ValueError(f"input: dtype {input.dtype}, expected torch.bfloat16 or torch.float16")
        for name, t, shape in (("input", input, (T, H)), ("residual", residual, (T, H)), ("weight", weight, (H,))):
            if tuple(t.shape) != shape or t.dtype != input.dtype or not t.is_contiguous() or t.device != input.device:
                raise ValueError(f"{name}: expected a contiguous {input.dtype} tensor of shape {shape} on {input.device}")
        return T, H

    def _raise(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"FlashInfer {what}: {self.lib.moe_ar_fi_error_string(err).decode()}")

    def fused_add_rmsnorm(self, input, residual, weight, eps: float, pdl: bool = True) -> None:
        """FlashInfer's fused_add_rmsnorm: residual += input, input = RMSNorm(residual) * weight."""
        import torch
        T, H = self._check(input, residual, weight)
        self._raise(self.lib.moe_ar_fi_fused_add_rmsnorm(
            input.data_ptr(), residual.data_ptr(), weight.data_ptr(), T, H, DTYPE_CODES[str(input.dtype)], eps,
            int(pdl), torch.cuda.current_stream(input.device).cuda_stream), "fused_add_rmsnorm")

    def fused_add_rmsnorm_quant(self, out, input, residual, weight, scale_value: float, scale_tensor, eps: float,
                                pdl: bool = True) -> None:
        """FlashInfer's fused_add_rmsnorm_quant to FP8 E4M3: residual += input, out = e4m3(RMSNorm(residual)
        * weight / scale). The scale is given both ways, a float and the same value in a [1] float32
        device tensor: the release fetched takes one of them (VERSION.json `scale_on_device`)."""
        import torch
        T, H = self._check(input, residual, weight)
        if out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (T, H) or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous torch.float8_e4m3fn tensor of shape {(T, H)}")
        self._raise(self.lib.moe_ar_fi_fused_add_rmsnorm_fp8(
            input.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), T, H,
            DTYPE_CODES[str(input.dtype)], scale_value, scale_tensor.data_ptr(), eps, int(pdl),
            torch.cuda.current_stream(input.device).cuda_stream), "fused_add_rmsnorm_quant")


def load(dest: pathlib.Path = DEFAULT_DIR, capability: tuple = (9, 0)) -> FlashInferNorm:
    """The library for a GPU of `capability`: the one built where the headers were fetched when it
    loads, else one built here with nvcc. Unavailable with the reason when neither works."""
    dest = pathlib.Path(dest)
    info = read_info(dest)
    prebuilt = info.get("library")
    arch = f"sm_{capability[0]}{capability[1]}"
    problems = []
    if prebuilt and arch in prebuilt["arches"]:
        if prebuilt["key"] != source_key(dest, info, prebuilt["arches"]):
            problems.append("the prebuilt library is stale (flashinfer_norm.cu changed since the fetch)")
        else:
            try:
                return FlashInferNorm(dest / prebuilt["path"], info)
            except OSError as e:
                problems.append(f"the prebuilt library does not load: {e}")
    try:
        return FlashInferNorm(build(dest, (arch,)), info)
    except (Unavailable, OSError) as e:
        raise Unavailable("; ".join(problems + [str(e)])) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ar_tools.baselines.flashinfer_norm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("extract", help="the norm kernels' headers of a flashinfer-python wheel into DEST")
    p.add_argument("wheel", type=pathlib.Path)
    p.add_argument("dest", type=pathlib.Path)
    p = sub.add_parser("build", help="build the library here with nvcc and record it in DEST/VERSION.json")
    p.add_argument("dest", type=pathlib.Path)
    p.add_argument("--arch", action="append", help=f"[default: {' '.join(DEFAULT_ARCHES)}]")
    args = parser.parse_args(argv)
    if args.command == "extract":
        info = extract(args.wheel, args.dest)
        print(f"flashinfer-python {info['version']}: {len(info['files'])} headers into {args.dest / 'include'} "
              f"(FP8 scale {'on the device' if info['scale_on_device'] else 'a float'})")
        return 0
    arches = tuple(args.arch or DEFAULT_ARCHES)
    try:
        library = build(args.dest, arches)
    except Unavailable as e:
        print(f"not built: {e}", file=sys.stderr)
        return 1
    record_prebuilt(args.dest, library, arches)
    print(f"built {library} for {', '.join(arches)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
