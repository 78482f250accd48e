"""Check generated/ against its manifest before anything is compiled from it.

Pure standard library and self-contained (no imports from this package, no
jinja2, torch or cupy): the runtime keeps a verbatim copy of this module, since
the runtime never imports the generator.

    manifest = load_verified_manifest(generated_dir)   # raises ManifestError
    text = source_for(manifest, generated_dir, "moe_ar_ts_bf16_ws4_o110")

`source_for` returns one self-contained translation unit (the program with its
`#include` of the body replaced by the body's text), so a compile cache keyed
on the source string changes whenever either file changes.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

MANIFEST_NAME = "manifest.json"
# 2: records of families and output profiles (profiles named by their quant= value), the regime
# ladder in `selection`, code_sha256 blind to comments.
FORMAT = 2
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
    # The per-program and body entries must agree with the file list.
    for entry in [manifest["body"], *manifest["programs"]]:
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


def source_for(manifest: dict, generated_dir: pathlib.Path, program_name: str) -> str:
    """The program's translation unit with the body inlined: what NVRTC compiles.

    The program file holds exactly one line `#include "<body file name>"`; it is
    replaced by the body's text. Both files are re-checked against the manifest.
    """
    entry = program_entry(manifest, program_name)
    body = manifest["body"]
    body_text = _read_checked(generated_dir, body["file"], body["sha256"], body["bytes"]).decode("utf-8")
    program_text = _read_checked(generated_dir, entry["file"], entry["sha256"], entry["bytes"]).decode("utf-8")
    include = f'#include "{pathlib.PurePosixPath(body["file"]).name}"'
    lines = program_text.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == include]
    if len(hits) != 1:
        raise ManifestError(f"generated/{entry['file']}: expected exactly one line {include!r}, "
                            f"found {len(hits)}; {REGENERATE}")
    if not body_text.endswith("\n"):
        body_text += "\n"
    lines[hits[0]] = body_text
    return "".join(lines)
