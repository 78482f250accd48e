"""moe_ar_tools/sass_diff.py: normalization, comparison, pairing and the cubin repair on synthetic
SASS and ELF bytes (CPU); one small real compile + disassembly under the `compile` marker."""
from __future__ import annotations

import pathlib
import struct

import pytest

from moe_ar_tools import sass_diff as sd

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sass(symbol: str, *, pad: int = 0, fmad: str = "FFMA R5, R0, R2, R3", banner: bool = False) -> str:
    """A cuobjdump -sass listing in its layout: header, Function line, two-line instructions padded to
    a column (pad widens it, as a longer line elsewhere does), an internal function named after the kernel."""
    col = " " * (30 + pad)
    lines = []
    if banner:
        lines += ["", "Fatbin elf code:", "================", "arch = sm_90a", "code version = [1,8]",
                  "host = linux", f"identifier = /tmp/build_{pad}/{symbol}.cubin", "compile_size = 64bit"]
    lines += ["", "\tcode for sm_90a", "\t.target\tsm_90a", "", f"\t\tFunction : {symbol}",
              '\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"',
              f"        /*0000*/                   LDC R1, c[0x0][0x28] ;{col}/* 0x00000a00ff017b82 */",
              f"                                                                {col}/* 0x000fe20000000800 */",
              f"        /*0010*/                   {fmad} ;{col}/* 0x0000000200057223 */",
              f"                                                                {col}/* 0x004fca0000000003 */",
              f"        /*0020*/                   CALL.REL.NOINC `(${symbol}$__internal_fdiv) ;{col}/* 0x0000000000007944 */",
              f"                                                                {col}/* 0x000fea0003c00000 */",
              f"        /*0030*/                   EXIT ;{col}/* 0x000000000000794d */",
              "\t\t..........", "", "", f"\t\tFunction : ${symbol}$__internal_fdiv",
              f"        /*0000*/                   RET.ABS.NODEC R20 0x0 ;{col}/* 0x0000000014007950 */", ""]
    return "\n".join(lines)


OLD, NEW = "moe_ar_os_bf16_ws2_o110", "moe_ar_oneshot_bf16_ws2_plain"


# ---- normalization ------------------------------------------------------------------------------

def test_normalize_puts_the_placeholder_for_every_use_of_the_symbol():
    lines = sd.normalize(_sass(NEW), NEW)
    assert f"Function : {sd.PLACEHOLDER}" in lines
    assert f"Function : ${sd.PLACEHOLDER}$__internal_fdiv" in lines
    assert any(f"CALL.REL.NOINC `(${sd.PLACEHOLDER}$__internal_fdiv)" in line for line in lines)
    assert not any(NEW in line for line in lines)
    assert sd.normalize(_sass(NEW)) != lines  # without a symbol nothing is replaced
    assert any(NEW in line for line in sd.normalize(_sass(NEW)))


def test_normalize_drops_blank_and_banner_lines_and_padding_but_keeps_code_and_encodings():
    lines = sd.normalize(_sass(NEW, banner=True), NEW)
    assert lines == sd.normalize(_sass(NEW), NEW)  # the fat-binary banner (file name and all) is gone
    assert "" not in lines and not any("  " in line or "\t" in line for line in lines)
    assert "/*0010*/ FFMA R5, R0, R2, R3 ; /* 0x0000000200057223 */" in lines
    assert "/* 0x004fca0000000003 */" in lines  # the second half of the encoding stays
    assert "code for sm_90a" in lines and ".target sm_90a" in lines
    assert sd.normalize(_sass(NEW, pad=17), NEW) == lines


# ---- comparison ---------------------------------------------------------------------------------

def test_same_text_is_identical():
    assert sd.compare(_sass(NEW), NEW, _sass(NEW, pad=3), NEW) == sd.Comparison(sd.IDENTICAL, ())


def test_renamed_kernel_with_the_same_code_is_identical_but_the_name():
    assert sd.compare(_sass(OLD), OLD, _sass(NEW, pad=2), NEW) == sd.Comparison(sd.RENAMED, ())


@pytest.mark.parametrize("new_sass", [
    _sass(NEW, fmad="FMUL R5, R0, R2"),                               # an instruction changed
    _sass(NEW).replace("0x004fca0000000003", "0x004fca0000000007"),  # only the encoding (scheduling bits)
    _sass(NEW).replace("RET.ABS.NODEC R20", "RET.ABS.NODEC R22"),    # in the internal function
    _sass(NEW).replace("sm_90a", "sm_100a"),                        # another target
])
def test_a_code_change_is_different_under_a_rename_too(new_sass):
    for old, old_symbol in ((_sass(NEW), NEW), (_sass(OLD), OLD)):
        result = sd.compare(old, old_symbol, new_sass, NEW)
        assert result.status == sd.DIFFERENT
        changed = [line for line in result.diff if line[:1] in "-+" and line[:3] not in ("---", "+++")]
        assert changed and not any(OLD in line or NEW in line for line in changed)  # never the name
        assert len(result.diff) <= sd.DIFF_LINES


def test_the_diff_shows_the_first_differing_lines():
    result = sd.compare(_sass(OLD), OLD, _sass(NEW, fmad="FMUL R5, R0, R2"), NEW)
    minus = [line for line in result.diff if line.startswith("-/*")]
    plus = [line for line in result.diff if line.startswith("+/*")]
    assert minus == ["-/*0010*/ FFMA R5, R0, R2, R3 ; /* 0x0000000200057223 */"]
    assert plus == ["+/*0010*/ FMUL R5, R0, R2 ; /* 0x0000000200057223 */"]


def test_another_kernels_name_is_not_taken_for_the_placeholder():
    # The old listing names a kernel that is not the old program's: that is a difference.
    result = sd.compare(_sass("moe_ar_oneshot_bf16_ws2_other"), OLD, _sass(NEW), NEW)
    assert result.status == sd.DIFFERENT


# ---- pairing and the report ---------------------------------------------------------------------

def _entry(name, family="oneshot", dtype="bf16", world_size=2, profile="plain"):
    return {"name": name, "symbol": name, "family": family, "dtype": dtype, "world_size": world_size,
            "profile": profile}


def test_programs_pair_by_cell_not_by_name():
    old = [_entry("moe_ar_os_bf16_ws2_o110"), _entry("moe_ar_os_bf16_ws2_o111", profile="nvfp4"),
           _entry("moe_ar_os_bf16_ws4_o110", world_size=4), _entry("moe_ar_twoshot_bf16_ws2_fp8_tensor", "twoshot",
                                                                  profile="fp8_tensor")]
    new = [_entry("moe_ar_twoshot_bf16_ws2_fp8_tensor", "twoshot", profile="fp8_tensor"),
           _entry("moe_ar_oneshot_bf16_ws2_plain"), _entry("moe_ar_oneshot_bf16_ws2_nvfp4", profile="nvfp4"),
           _entry("moe_ar_oneshot_fp16_ws2_plain", dtype="fp16")]
    pairs, only_old, only_new = sd.pair(old, new)
    assert [(o["name"], n["name"]) for o, n in pairs] == [  # in the new manifest's order
        ("moe_ar_twoshot_bf16_ws2_fp8_tensor", "moe_ar_twoshot_bf16_ws2_fp8_tensor"),
        ("moe_ar_os_bf16_ws2_o110", "moe_ar_oneshot_bf16_ws2_plain"),
        ("moe_ar_os_bf16_ws2_o111", "moe_ar_oneshot_bf16_ws2_nvfp4")]
    assert [e["name"] for e in only_old] == ["moe_ar_os_bf16_ws4_o110"]
    assert [e["name"] for e in only_new] == ["moe_ar_oneshot_fp16_ws2_plain"]
    assert sd.pair([], new) == ([], [], new)


def test_two_programs_in_one_cell_are_refused():
    with pytest.raises(ValueError, match="old: two programs in cell oneshot bf16 ws2 plain"):
        sd.pair([_entry("a"), _entry("b")], [_entry("c")])


def test_rows_counts_and_verdict():
    pairs = [(_entry(OLD), _entry(NEW)), (_entry("moe_ar_oneshot_bf16_ws2_fp8_tensor", profile="fp8_tensor"),
                                          _entry("moe_ar_oneshot_bf16_ws2_fp8_tensor", profile="fp8_tensor"))]
    fp8 = "moe_ar_oneshot_bf16_ws2_fp8_tensor"
    results = {("old", OLD, "sm_90a"): {"sass": _sass(OLD)},
               ("new", NEW, "sm_90a"): {"sass": _sass(NEW)},
               ("old", fp8, "sm_90a"): {"sass": _sass(fp8)},
               ("new", fp8, "sm_90a"): {"sass": _sass(fp8)},
               ("old", OLD, "sm_100a"): {"sass": _sass(OLD)},
               ("new", NEW, "sm_100a"): {"sass": _sass(NEW, fmad="FMUL R5, R0, R2")},
               ("old", fp8, "sm_100a"): {"sass": _sass(fp8)},
               ("new", fp8, "sm_100a"): {"error": "NVRTC error:\nboom"}}
    rows = sd.compare_all(pairs, ["sm_90a", "sm_100a"], results)
    assert [(r["new"], r["arch"], r["status"]) for r in rows] == [
        (NEW, "sm_90a", sd.RENAMED), (NEW, "sm_100a", sd.DIFFERENT),
        (fp8, "sm_90a", sd.IDENTICAL), (fp8, "sm_100a", sd.FAILED)]
    assert rows[0]["cell"] == {"family": "oneshot", "dtype": "bf16", "world_size": 2, "profile": "plain"}
    assert rows[3]["error"] == "new: NVRTC error:\nboom"
    counts = sd.counts(rows, ["sm_90a", "sm_100a"])
    assert counts == {"sm_90a": {sd.IDENTICAL: 1, sd.RENAMED: 1, sd.DIFFERENT: 0, sd.FAILED: 0},
                      "sm_100a": {sd.IDENTICAL: 0, sd.RENAMED: 0, sd.DIFFERENT: 1, sd.FAILED: 1}}
    report = {"old": "old", "new": "new", "nvrtc": "NVRTC 13.5", "tools": "cuobjdump", "archs": ["sm_90a", "sm_100a"],
              "counts": counts, "rows": rows, "only_old": [], "only_new": [{"cell": "x", "name": "y"}]}
    text = "\n".join(sd.summary_lines(report))
    assert f"==== {NEW} sm_100a: DIFFERENT" in text and "-/*0010*/ FFMA R5, R0, R2, R3" in text
    assert f"==== {fp8} sm_100a: FAILED" in text and "boom" in text
    assert "cell only in the new tree: x (y)" in text and "every cell" not in text
    assert "every cell selected in one tree has a program in the other" in sd.summary_lines(dict(report, only_new=[]))
    assert text.endswith("2 of 4 (program, arch) the same SASS (1 identical, 1 renamed, identical but the symbol name); "
                         "2 differ or failed; archs sm_90a, sm_100a")


def test_progress_clock():
    assert sd.clock(0) == "0:00" and sd.clock(59.6) == "1:00" and sd.clock(3725) == "1:02:05"
    assert sd.time_left(10.0, 0, 5) is None and sd.time_left(10.0, 2, 6) == 30.0


def test_cache_name_is_per_source_and_arch_and_toolchain():
    build = sd.Build("old", "p", "sm_90a", "source", ("--gpu-architecture=sm_90a",))
    same_source = sd.Build("new", "q", "sm_90a", "source", ("--gpu-architecture=sm_90a",))
    assert build.cache_name("t") == same_source.cache_name("t")  # the tree and name are not part of it
    assert build.cache_name("t").split("-")[1] == "sm_90a"
    for other in (sd.Build("old", "p", "sm_90a", "source2", build.options),
                  sd.Build("old", "p", "sm_100a", "source", ("--gpu-architecture=sm_100a",)),
                  sd.Build("old", "p", "sm_90a", "source", ("--gpu-architecture=sm_90a", "--fmad=false"))):
        assert other.cache_name("t") != build.cache_name("t")
    assert build.cache_name("t") != build.cache_name("another toolchain")


# ---- the cubin CuPy returns ---------------------------------------------------------------------

def _elf(sections: list[tuple[int, bytes]]) -> bytes:
    """A 64-bit ELF as NVRTC lays a cubin out: header, section data, section headers, program headers last."""
    data = b"".join(body for _, body in sections)
    shoff = 64 + len(data)
    shnum, phnum = len(sections) + 1, 2
    phoff = shoff + shnum * 64
    header = (b"\x7fELF\x02\x01\x01\x41\x08" + bytes(7)
              + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, phoff, shoff, 0, 64, 56, phnum, 64, shnum, 1))
    shdrs, offset = bytes(64), 64
    for sh_type, body in sections:
        shdrs += struct.pack("<IIQQQQIIQQ", 0, sh_type, 0, 0, offset if sh_type != 8 else shoff, len(body), 0, 0, 1, 0)
        offset += len(body)
    phdrs = b"".join(struct.pack("<IIQQQQQQ", 1, 5, 64, 0, 0, len(data), len(data), 8) for _ in range(phnum))
    return header + data + shdrs + phdrs


def test_complete_cubin_puts_back_the_last_byte_cupy_drops():
    cubin = _elf([(1, b"code" * 8), (8, b""), (1, b"more")])
    assert sd.complete_cubin(cubin) == cubin
    assert sd.complete_cubin(cubin[:-1]) == cubin  # the last byte is the program headers' p_align high byte: 0
    assert sd.complete_cubin(cubin[:-3]) == cubin


def test_complete_cubin_refuses_what_it_cannot_repair():
    cubin = _elf([(1, b"code" * 8)])
    with pytest.raises(ValueError, match="not a 64-bit"):
        sd.complete_cubin(b"\x7fELF\x01" + cubin[5:])
    with pytest.raises(ValueError, match="not a 64-bit"):
        sd.complete_cubin(b"junk")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    with pytest.raises(ValueError, match="not only in its program header table"):
        sd.complete_cubin(cubin[:shoff + 10])  # part of the section header table is gone too
    # a section whose data lies past the end (a layout other than NVRTC's): refused, never padded
    bad = bytearray(cubin)
    struct.pack_into("<Q", bad, shoff + 64 + 0x18, len(cubin) - 2)
    with pytest.raises(ValueError, match="section 1 runs past the end"):
        sd.complete_cubin(bytes(bad[:-1]))


# ---- the trees -------------------------------------------------------------------------------------

def test_a_trees_generator_loads_under_its_own_name_and_builds_its_sources():
    """A tree's generator loads under its own name; this tree's manifest reader and CUDA environment
    live in moe_ar_common/, which the tree's module() loads from the tree, under a name of its own."""
    from moe_ar_common import manifest_reader

    tree = sd.working_tree()
    sd.load_generator(tree, "_sass_diff_test_generator")
    own = tree.module("verify")
    assert own is not manifest_reader and own.__name__ == "_sass_diff_test_generator_common_manifest_reader"
    assert pathlib.Path(own.__file__).resolve() == ROOT / "moe_ar_common" / "manifest_reader.py"
    assert tree.module("nvrtc_build").__name__ == "_sass_diff_test_generator.nvrtc_build"
    manifest = sd.manifest_of(tree)
    name = manifest["programs"][0]["name"]
    assert own.source_for(manifest, ROOT / "generated", name) == \
        manifest_reader.source_for(manifest, ROOT / "generated", name)


# ---- one real compile ----------------------------------------------------------------------------

@pytest.mark.compile
def test_real_sass_of_a_renamed_program_is_identical_but_the_name(tmp_path):
    """One program for sm_90a, NVRTC as the runtime calls it: renamed -> renamed, identical;
    the same source with -ftz=true -> DIFFERENT; a second run reads everything from the cache."""
    tools = sd.find_tools()
    tree = sd.working_tree()
    sd.load_generator(tree, "_sass_diff_compile_generator")
    manifest = sd.manifest_of(tree)
    entry = next(e for e in manifest["programs"] if (e["family"], e["dtype"], e["world_size"], e["profile"])
                 == ("oneshot", "bf16", 2, "plain"))
    (build,) = sd.builds_of(tree, "old", [entry], ["sm_90a"])
    renamed = entry["name"] + "_renamed"
    assert build.source.count(entry["name"]) >= 1
    builds = [build, sd.Build("new", renamed, "sm_90a", build.source.replace(entry["name"], renamed), build.options),
              sd.Build("new", "ftz", "sm_90a", build.source,
                       tuple(o.replace("-ftz=false", "-ftz=true") for o in build.options))]
    assert builds[2].options != build.options
    results = sd.run_builds(builds, tools, tmp_path, "toolchain", jobs=2)
    old, new, ftz = (results[(b.tree, b.program, "sm_90a")] for b in builds)
    assert "error" not in old and "error" not in new and "error" not in ftz
    assert f"Function : {entry['symbol']}" in old["sass"] and f"Function : {renamed}" in new["sass"]
    assert sd.compare(old["sass"], entry["symbol"], new["sass"], renamed).status == sd.RENAMED
    assert sd.compare(old["sass"], entry["symbol"], ftz["sass"], entry["symbol"]).status == sd.DIFFERENT
    again = sd.run_builds(builds, tools, tmp_path, "toolchain", jobs=2)
    assert all(r.get("cached") for r in again.values()) and again[("old", entry["name"], "sm_90a")]["sass"] == old["sass"]


def test_what_cannot_be_compared_exits_2_naming_it():
    from click.testing import CliRunner

    result = CliRunner().invoke(sd.main, ["no-such-revision"])
    assert result.exit_code == 2 and "'no-such-revision' is not a git revision" in result.output, result.output
    result = CliRunner().invoke(sd.main, ["HEAD", "--family", "twoshot_pipelined", "--world-size", "4"])
    assert result.exit_code == 2 and "twoshot_pipelined has no program at world size 4" in result.output, result.output
