"""Check generated/ against its manifest before anything is compiled from it.

Pure standard library and self-contained (no imports from this package, no
jinja2, torch or cupy): the generator and the runtime both read generated/
through it (they never import each other).

    manifest = load_verified_manifest(generated_dir)   # raises ManifestError
    text = source_for(manifest, generated_dir, "moe_ar_twoshot_bf16_ws4_plain")

`source_for` returns one self-contained translation unit: the program with each
`#include "name"` line replaced by the text of the body header
generated/<include_dir>/name, recursively, a header with `#pragma once` only at
its first include. Every file is checked against the manifest before it is
used, and a compile cache keyed on the source string changes whenever any of
them changes. `#include <...>` lines stay for NVRTC (the CUDA headers).
"""
from __future__ import annotations

import hashlib
import json
import pathlib

MANIFEST_NAME = "manifest.json"
# 2: records of families and output profiles (profiles named by their quant= value), the regime
# ladder in `selection`, code_sha256 blind to comments.
# 3: the body is a set of headers (`body`: entry, include_dir, headers), inlined recursively.
# 4: the selection boundaries come in table sets (`selection.sets`, the written model last), each
# cell counted in its own key (tokens or bytes per rank) with its measured range.
# 5: program names spell the family; each family lists its world sizes, holes are cells of those
# only, and `selection.no_peers` names the family every exchange rung runs at world size 1.
FORMAT = 5
REGENERATE = "run `gen-programs` to regenerate"


class ManifestError(RuntimeError):
    """generated/ is missing, stale or does not match its manifest."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_manifest(generated_dir: pathlib.Path) -> dict:
    """Parse manifest.json without checking the files it lists."""
    path = pathlib.Path(generated_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing; {REGENERATE}") from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise ManifestError(f"{path}: not valid JSON ({e}); {REGENERATE}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                            f"this reader knows format {FORMAT}; {REGENERATE}")
    return manifest


def _read_checked(generated_dir: pathlib.Path, rel: str, sha256: str, size: int) -> bytes:
    path = pathlib.Path(generated_dir) / rel
    if pathlib.PurePosixPath(rel).is_absolute() or ".." in pathlib.PurePosixPath(rel).parts:
        raise ManifestError(f"{MANIFEST_NAME}: file path {rel!r} leaves generated/; {REGENERATE}")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"generated/{rel}: missing (listed in {MANIFEST_NAME}); {REGENERATE}") from None
    if len(data) != size or sha256_bytes(data) != sha256:
        raise ManifestError(
            f"generated/{rel}: does not match {MANIFEST_NAME} ({len(data)} bytes, sha256 "
            f"{sha256_bytes(data)[:16]}..., expected {size} bytes, sha256 {sha256[:16]}...); "
            f"it was edited by hand or is stale; {REGENERATE}")
    return data


def verify_manifest(manifest: dict, generated_dir: pathlib.Path) -> None:
    """Check every listed file's size and sha256; raise ManifestError on the first mismatch."""
    files = manifest["files"]
    for rel in sorted(files):
        _read_checked(generated_dir, rel, files[rel]["sha256"], files[rel]["bytes"])
    # The per-program and body header entries must agree with the file list.
    for entry in [*manifest["body"]["headers"], *manifest["programs"]]:
        listed = files.get(entry["file"])
        if listed is None or listed["sha256"] != entry["sha256"] or listed["bytes"] != entry["bytes"]:
            raise ManifestError(f"{MANIFEST_NAME}: entry for generated/{entry['file']} disagrees with its "
                                f"file list; {REGENERATE}")


def load_verified_manifest(generated_dir: pathlib.Path) -> dict:
    """The manifest of generated_dir, after checking every file it lists."""
    manifest = load_manifest(generated_dir)
    verify_manifest(manifest, generated_dir)
    return manifest


def program_entry(manifest: dict, program_name: str) -> dict:
    for entry in manifest["programs"]:
        if entry["name"] == program_name:
            return entry
    raise ManifestError(f"{MANIFEST_NAME}: no program {program_name!r} (a hole, or not generated); {REGENERATE}")


def quoted_include(line: str) -> str | None:
    """The name in a line `#include "name"` (a trailing // comment allowed), else None."""
    text = line.strip()
    if not text.startswith("#"):
        return None
    rest = text[1:].lstrip()
    if not rest.startswith("include"):
        return None
    rest = rest[len("include"):].lstrip()
    if not rest.startswith('"') or '"' not in rest[1:]:
        return None
    end = rest.index('"', 1)
    tail = rest[end + 1:].strip()
    if tail and not tail.startswith("//"):
        return None
    return rest[1:end]


def has_pragma_once(text: str) -> bool:
    return any("".join(line.split()) == "#pragmaonce" for line in text.splitlines())


def inline_includes(text: str, origin: str, include_dir: str, read) -> tuple[str, list[str]]:
    """text (the file `origin`, relative to generated/) with every `#include "name"` line replaced by
    the text of include_dir/name, recursively, as the preprocessor would include it: a header with
    `#pragma once` at its first include only (later includes of it become nothing), one without at
    every include (every such line counts: the body headers put none in comments or #if blocks).
    read(rel, including) returns the text of header rel, included by file `including`, or raises
    ManifestError. Returns the source and the headers in the order they were first inlined."""
    out: list[str] = []
    order: list[str] = []
    once: set[str] = set()

    def expand(body: str, where: str, stack: tuple[str, ...]) -> None:
        for line in body.splitlines(keepends=True):
            name = quoted_include(line)
            if name is None:
                out.append(line)
                continue
            rel = f"{include_dir}/{name}"
            if rel in once:
                continue
            if rel in stack:
                raise ManifestError(f"generated/{where}: includes {name!r} within itself "
                                    f"({' -> '.join(stack + (rel,))}); {REGENERATE}")
            header = read(rel, where)
            if has_pragma_once(header):
                once.add(rel)
            if rel not in order:
                order.append(rel)
            expand(header if header.endswith("\n") else header + "\n", rel, stack + (rel,))

    expand(text, origin, (origin,))
    return "".join(out), order


def _checked_header_reader(manifest: dict, generated_dir: pathlib.Path):
    """read(rel, including) for inline_includes: a body header listed in the manifest, checked."""
    headers = {h["file"]: h for h in manifest["body"]["headers"]}

    def read(rel: str, including: str) -> str:
        entry = headers.get(rel)
        if entry is None:
            raise ManifestError(f"generated/{including}: includes {rel.rsplit('/', 1)[-1]!r}, which is not a "
                                f"body header of {MANIFEST_NAME}; {REGENERATE}")
        return _read_checked(generated_dir, rel, entry["sha256"], entry["bytes"]).decode("utf-8")
    return read


def source_for(manifest: dict, generated_dir: pathlib.Path, program_name: str) -> str:
    """The program's translation unit with the body headers inlined: what NVRTC compiles.
    The program and every header it includes are re-checked against the manifest."""
    entry = program_entry(manifest, program_name)
    program_text = _read_checked(generated_dir, entry["file"], entry["sha256"], entry["bytes"]).decode("utf-8")
    source, _ = inline_includes(program_text, entry["file"], manifest["body"]["include_dir"],
                                _checked_header_reader(manifest, generated_dir))
    return source


def body_source(manifest: dict, generated_dir: pathlib.Path) -> str:
    """The body alone (its entry header with everything it includes inlined), checked: what a
    program includes, for code that calls the body's device functions."""
    body = manifest["body"]
    entry = body["entry"]
    name = entry[len(body["include_dir"]) + 1:]
    source, _ = inline_includes(f'#include "{name}"\n', "programs/", body["include_dir"],
                                _checked_header_reader(manifest, generated_dir))
    return source
