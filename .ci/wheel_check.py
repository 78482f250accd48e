"""The installed package, used from outside the repository (run by .ci/wheel_check.sh in a venv
holding the wheel and a CUDA extra, from a folder outside the source tree; no GPU needed).

    python wheel_check.py SOURCE_TREE NVRTC_MAJOR

Checks that dispatch, the moe_ar_common package it shares with the generator (the manifest reader,
the CUDA environment) and its programs come from the installed files, not from SOURCE_TREE; that
programs(), program_info() and the manifest verification work there; that the installed generated
tree holds exactly the files its manifest lists; and that one program compiles through the
runtime's NVRTC path (the cubin cache included) for sm_90a and sm_100a with NVRTC of NVRTC_MAJOR.
Prints one line per check; exits 1 on the first failure.
"""
from __future__ import annotations

import os
import pathlib
import sys
import tempfile

PROGRAM = "moe_ar_oneshot_bf16_ws2_plain"


def main() -> int:
    source = pathlib.Path(sys.argv[1]).resolve()
    nvrtc_major = int(sys.argv[2])

    import dispatch
    import moe_ar_common
    from dispatch import registry
    from moe_ar_common import cuda_env

    def outside(path) -> bool:
        return not pathlib.Path(path).resolve().is_relative_to(source)

    assert outside(dispatch.__file__), f"dispatch imported from the source tree: {dispatch.__file__}"
    assert outside(moe_ar_common.__file__), f"moe_ar_common imported from the source tree: {moe_ar_common.__file__}"
    assert outside(registry.GENERATED_DIR), f"programs read from the source tree: {registry.GENERATED_DIR}"
    assert registry.GENERATED_DIR.parent.name == "moe_ar_data", registry.GENERATED_DIR
    print(f"ok    dispatch from {pathlib.Path(dispatch.__file__).parent}, moe_ar_common from "
          f"{pathlib.Path(moe_ar_common.__file__).parent}, programs from {registry.GENERATED_DIR}")

    ps = registry.program_set()  # verifies every file the manifest lists (size and sha256)
    names = dispatch.programs()
    assert names and names == sorted(p["name"] for p in ps.manifest["programs"]), names
    info = dispatch.program_info(PROGRAM)
    assert info["name"] == PROGRAM and info["file"] == f"programs/{PROGRAM}.cu", info
    try:
        dispatch.program_info("moe_ar_no_such_program")
        raise AssertionError("program_info accepted an unknown name")
    except ValueError as e:
        assert str(e).startswith("program: "), e
    print(f"ok    manifest verified: {len(names)} programs; program_info({PROGRAM!r}) -> {info['family']}, "
          f"{info['protocol_class']}")

    installed = sorted(p.relative_to(ps.dir).as_posix() for p in ps.dir.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    listed = sorted([*ps.manifest["files"], "manifest.json"])
    assert installed == listed, (f"installed files differ from the manifest: extra "
                                 f"{sorted(set(installed) - set(listed))}, missing {sorted(set(listed) - set(installed))}")
    print(f"ok    the installed tree holds exactly the manifest's {len(listed)} files")

    nvrtc, version = cuda_env.load_nvrtc()
    assert version[0] == nvrtc_major, f"NVRTC {version}, expected {nvrtc_major}.x"
    include = cuda_env.include_dir(version[0])
    assert outside(include) and cuda_env.header_major(include) == nvrtc_major, include
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MOE_AR_CACHE_DIR"] = os.path.join(cache, "moe_ar")
        for target in ("sm_90a", "sm_100a"):
            cubin, load = registry.cached_cubin(PROGRAM, target)
            assert load["source"] == "compiled" and cubin[:4] == b"\x7fELF", (load, cubin[:4])
            again, load = registry.cached_cubin(PROGRAM, target)
            assert load["source"] == "cache" and again == cubin, load
            print(f"ok    {PROGRAM} compiled for {target} with NVRTC {version[0]}.{version[1]} "
                  f"(headers {include}): {len(cubin)} bytes, read back from the cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
