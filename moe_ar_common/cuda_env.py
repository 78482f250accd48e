"""The CUDA pieces NVRTC compiles with: CuPy's NVRTC bindings and the CUDA headers.

Standard library at import (CuPy is imported by load_nvrtc only): the generator (gen-programs compile)
and the runtime both compile through it (they never import each other).

They come from the project's extras, one per CUDA major version (pyproject.toml):
    cu13: cupy-cuda13x, nvidia-cuda-nvrtc 13.x, nvidia-cuda-runtime 13.x (headers in nvidia/cu13/include)
    cu12: cupy-cuda12x, nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12 (headers in nvidia/cuda_runtime/include)
The headers must be of NVRTC's major version; pip's come first, then a toolkit in $CUDA_HOME,
$CUDA_PATH or /usr/local/cuda.
"""
from __future__ import annotations

import importlib.metadata
import os
import re

EXTRAS = {13: "cu13", 12: "cu12"}
# Toolkits looked at after pip's headers, $CUDA_HOME and $CUDA_PATH.
TOOLKIT_DIRS = ("/usr/local/cuda",)
# The headers the programs include, and cuda_runtime.h, which every toolkit's include folder has.
REQUIRED_HEADERS = ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h")


class MissingToolchain(RuntimeError):
    """NVRTC or the CUDA headers are not installed; the message names the extra to install."""


def install_hint(extra: str | None = None) -> str:
    extra = extra or suggested_extra()
    if extra is None:
        return ("install the extra of your CUDA driver's major version (nvidia-smi shows it): "
                "pip install '.[cu13]' or pip install '.[cu12]' in the repository")
    return f"install the {extra} extra: pip install '.[{extra}]' in the repository"


def suggested_extra() -> str | None:
    """The extra matching what is installed: a CuPy build, else torch's CUDA build (its version's
    local part, +cu126 or +cu130, read without importing torch); None when nothing tells."""
    for major, extra in EXTRAS.items():
        try:
            importlib.metadata.version(f"cupy-cuda{major}x")
            return extra
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        local = importlib.metadata.version("torch").partition("+")[2]
    except importlib.metadata.PackageNotFoundError:
        return None
    m = re.fullmatch(r"cu(\d\d)\d*", local)
    return EXTRAS.get(int(m.group(1))) if m else None


def load_nvrtc():
    """(cupy.cuda.nvrtc, NVRTC's (major, minor)); MissingToolchain when either is missing."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as e:
        raise MissingToolchain(f"NVRTC: CuPy is not installed ({e}); {install_hint()}") from None
    try:
        version = tuple(int(v) for v in nvrtc.getVersion())
    except Exception as e:  # CuPy present, libnvrtc not found (the error type depends on the CuPy version)
        raise MissingToolchain(f"NVRTC: CuPy cannot load libnvrtc ({type(e).__name__}: {e}); "
                               f"{install_hint()}") from None
    return nvrtc, version


def header_major(include_dir: str) -> int | None:
    """The CUDA major version of the headers in include_dir (cuda.h's CUDA_VERSION), None if unknown."""
    try:
        with open(os.path.join(include_dir, "cuda.h"), encoding="utf-8", errors="replace") as f:
            m = re.search(r"^\s*#\s*define\s+CUDA_VERSION\s+(\d+)", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) // 1000 if m else None


def _candidates() -> list[str]:
    """Include folders that hold the required headers, in the order they are preferred."""
    dirs = []
    try:
        import nvidia  # namespace package of pip's nvidia-* wheels
        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        # CUDA 13 and later: nvidia/cu<major>/include, newest first; CUDA 12: nvidia/cuda_runtime/include.
        majors = sorted((n for n in names if re.fullmatch(r"cu\d+", n)), key=lambda n: -int(n[2:]))
        dirs += [os.path.join(root, n, "include") for n in majors]
        dirs.append(os.path.join(root, "cuda_runtime", "include"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "include"))
    dirs += [os.path.join(d, "include") for d in TOOLKIT_DIRS]
    return [d for d in dirs if all(os.path.isfile(os.path.join(d, h)) for h in REQUIRED_HEADERS)]


def include_dir(nvrtc_major: int | None = None) -> str:
    """The CUDA include folder for NVRTC of this major version (None: the first found).
    MissingToolchain naming the extra when there is none."""
    found = [(d, header_major(d)) for d in _candidates()]
    for d, major in found:
        if nvrtc_major is None or major == nvrtc_major:
            return d
    seen = "; found only " + ", ".join(f"{d} (CUDA {m})" for d, m in found) if found else ""
    want = f"CUDA {nvrtc_major} headers (NVRTC is {nvrtc_major}.x)" if nvrtc_major else "CUDA headers"
    raise MissingToolchain(f"{want} not found{seen}; {install_hint(EXTRAS.get(nvrtc_major))}, "
                           f"or set CUDA_HOME to a CUDA toolkit of that version")
