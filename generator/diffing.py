"""`gen-programs diff REV`: what changed in the tables since a git revision.

Compares two manifests cell by cell (family x dtype x world size x profile):
a program that appeared or vanished, a program whose compiled code changed
(code_sha256: its tokens and those of the body headers it includes, comments and
layout aside), and selection boundaries that moved. Also whole-table facts: body,
parameter plan, targets. The revision's code hashes are computed afresh from its
files, so a change in how the hash is defined never shows as a code change. A
revision whose body is split into other files (manifest format 2 had one body
file) hashes other texts: the diff then says so instead of comparing programs.
"""
from __future__ import annotations

import json
import subprocess

from moe_ar_common.manifest_reader import ManifestError, inline_includes

from . import spec, tuning
from .code_hash import code_sha256

# Manifests of format 1 called the first two profiles by their numeric codes.
_FORMAT1_PROFILES = {"110": spec.PLAIN, "111": "nvfp4"}
# Manifests before format 4 had one selection table, in tokens: the one that became this set.
_SINGLE_TABLE_SET = "h200_nvlink"


def _git_files(rev: str, root, paths: list[str]) -> dict[str, bytes]:
    """{path: bytes} of the files at rev (one `git cat-file --batch`); a missing one is left out."""
    batch = "".join(f"{rev}:{path}\n" for path in paths).encode()
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=root, input=batch, capture_output=True, check=True).stdout
    files, offset = {}, 0
    for path in paths:
        end = out.index(b"\n", offset)
        header = out[offset:end].split()
        offset = end + 1
        if header[-1] == b"missing":
            continue
        size = int(header[2])
        files[path] = out[offset:offset + size]
        offset += size + 1
    return files


def body_files(manifest: dict) -> list[str]:
    """The body's files in the order a program inlines them (format 2: the one body file)."""
    body = manifest["body"]
    return [h["file"] for h in body["headers"]] if "headers" in body else [body["file"]]


def body_entry(manifest: dict) -> str:
    """The body file a program includes."""
    body = manifest["body"]
    return body["entry"] if "headers" in body else body["file"]


def _with_todays_code_hashes(manifest: dict, rev: str, root, generated: str) -> dict:
    """The manifest with every code_sha256 computed from rev's files as generator/render.py does today:
    a program's text, then the text of each body file it includes (inlined as manifest_reader.source_for does)."""
    body = manifest.get("body")
    if body is None:
        return manifest
    entries = manifest["programs"]
    headers = body_files(manifest)
    include_dir = body.get("include_dir", headers[0].rsplit("/", 1)[0])
    files = _git_files(rev, root, [f"{generated}/{rel}" for rel in [*headers, *(e["file"] for e in entries)]])
    texts = {rel: files[f"{generated}/{rel}"].decode("utf-8") for rel in headers if f"{generated}/{rel}" in files}
    if len(texts) != len(headers):
        return manifest

    def read(rel: str, including: str) -> str:
        if rel not in texts:
            raise ManifestError(f"{including} includes {rel}, which is not a body file")
        return texts[rel]

    body["code_sha256"] = code_sha256(*(texts[rel] for rel in headers))
    for entry in entries:
        text = files.get(f"{generated}/{entry['file']}")
        if text is None:
            continue
        text = text.decode("utf-8")
        try:
            included = inline_includes(text, entry["file"], include_dir, read)[1]
        except ManifestError:
            continue  # not a tree this generator can read: its recorded hash stays
        entry["code_sha256"] = code_sha256(text, *(texts[rel] for rel in included))
        today = _name_today(entry)
        if today not in (None, entry["name"]):  # renamed since: its hash as if it had today's name
            entry["code_sha256_as_named_today"] = code_sha256(text.replace(entry["name"], today),
                                                              *(texts[rel] for rel in included))
    return manifest


def _name_today(entry: dict) -> str | None:
    """The name today's generator gives the entry's cell; None where the cell no longer exists."""
    try:
        return spec.ProgramSpec(entry["family"], entry["dtype"], entry["world_size"], entry["profile"]).name
    except ValueError:
        return None


def _with_profile_names(manifest: dict) -> dict:
    """A format-1 manifest with its profiles called by name, as today's are."""
    if manifest.get("format", 1) >= 2:
        return manifest
    selection = manifest.get("selection", {})
    for entry in [*manifest.get("programs", []), *manifest.get("holes", []), *selection.get("boundaries", []),
                  *(row for table_set in selection.get("sets", []) for row in table_set["boundaries"])]:
        entry["profile"] = _FORMAT1_PROFILES.get(entry["profile"], entry["profile"])
    return manifest


def manifest_at(rev: str, root, path: str = "generated/manifest.json") -> dict | None:
    """The manifest committed at `rev` (code hashes recomputed, profiles by name), or None where
    that revision has none."""
    try:
        subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=root,
                       check=True, capture_output=True)
    except subprocess.CalledProcessError:
        raise ValueError(f"{rev!r} is not a git revision here") from None
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True)
    if shown.returncode != 0:
        return None
    manifest = _with_profile_names(json.loads(shown.stdout))
    return _with_todays_code_hashes(manifest, rev, root, path.rsplit("/", 1)[0])


def _cell_key(entry: dict) -> tuple:
    return (entry["family"], entry["dtype"], entry["world_size"], entry["profile"])


def _label(key: tuple) -> str:
    family, dtype, world_size, profile = key
    return f"{family} {dtype} ws{world_size} {profile}"


def _code_hash(entry: dict) -> str:
    return entry["code_sha256"] if "code_sha256" in entry else entry["sha256"]


def _shown_bound(value, key: str) -> str:
    """A boundary as `tables` prints it; a manifest from before a field existed has none."""
    return "absent" if value is None else tuning.shown_limit(value, key)


def selection_sets(manifest: dict) -> dict:
    """{set name: {(dtype, world size, profile): row}} of a manifest's selection, rows as format 4
    writes them (key, limits, measured); a manifest with one table gives it as _SINGLE_TABLE_SET."""
    selection = manifest.get("selection", {})
    if "sets" in selection:
        return {s["name"]: {(b["dtype"], b["world_size"], b["profile"]): b for b in s["boundaries"]}
                for s in selection["sets"]}
    rows = {}
    for b in selection.get("boundaries", []):
        rows[(b["dtype"], b["world_size"], b["profile"])] = {
            "key": "tokens", "measured": None, "source": b.get("source"),
            "limits": {field: b[field] for field in spec.BOUNDARY_FIELDS if field in b}}
    return {_SINGLE_TABLE_SET: rows} if rows else {}


def diff_manifests(old: dict | None, new: dict) -> list[str]:
    """Human-readable change lines, old -> new; empty when nothing changed."""
    old = old or {"programs": [], "holes": [], "selection": {"boundaries": []}}
    lines = []
    # Code hashes cover the texts of the body's files, so they compare only within one split of the body.
    same_layout = "body" not in old or body_files(old) == body_files(new)
    if not same_layout:
        before, after = body_files(old), body_files(new)
        lines.append(f"~ kernel body layout changed: {len(before)} file{'s' if len(before) > 1 else ''} "
                     f"({', '.join(before)}) -> {len(after)} files ({', '.join(after)}); the programs' code "
                     f"hashes cover other texts, so code changes of programs present in both cannot be told "
                     f"from them and are not listed (compare the compiled cubins instead)")
    old_programs = {_cell_key(p): p for p in old["programs"]}
    new_programs = {_cell_key(p): p for p in new["programs"]}
    new_holes = {_cell_key(h): h for h in new["holes"]}
    old_holes = {_cell_key(h): h for h in old["holes"]}
    for key in sorted(set(old_programs) | set(new_programs)):
        before, after = old_programs.get(key), new_programs.get(key)
        if before is None:
            was = old_holes.get(key)
            why = f" (was a hole: {was['reason']})" if was else ""
            lines.append(f"+ {_label(key)}: appeared, {after['name']}{why}")
        elif after is None:
            hole = new_holes.get(key)
            why = f" (now a hole -> {hole['fallback_family'] or 'none'}: {hole['reason']})" if hole else ""
            lines.append(f"- {_label(key)}: vanished, {before['name']}{why}")
        elif before["name"] != after["name"]:
            same = same_layout and before.get("code_sha256_as_named_today") == _code_hash(after)
            lines.append(f"~ {_label(key)}: renamed {before['name']} -> {after['name']}, "
                         + ("same code but the name" if same else
                            f"code sha256 {_code_hash(before)[:12]} -> {_code_hash(after)[:12]}"))
        elif same_layout and _code_hash(before) != _code_hash(after):
            lines.append(f"~ {_label(key)}: program changed, {after['name']} "
                         f"code sha256 {_code_hash(before)[:12]} -> {_code_hash(after)[:12]}")
    for key in sorted(set(old_holes) & set(new_holes)):
        before, after = old_holes[key], new_holes[key]
        if (before["reason"], before["fallback_family"]) != (after["reason"], after["fallback_family"]):
            lines.append(f"~ {_label(key)}: hole now falls back to {after['fallback_family']} ({after['reason']}), "
                         f"was {before['fallback_family']} ({before['reason']})")

    old_sets, new_sets = selection_sets(old), selection_sets(new)
    for name in sorted(set(old_sets) - set(new_sets)):
        lines.append(f"- selection set {name}: removed ({len(old_sets[name])} cells)")
    for name in sorted(set(new_sets) - set(old_sets)):
        lines.append(f"+ selection set {name}: added ({len(new_sets[name])} cells)")
    for name in sorted(set(old_sets) & set(new_sets)):
        old_bounds, new_bounds = old_sets[name], new_sets[name]
        for key in sorted(set(old_bounds) | set(new_bounds)):
            dtype, world_size, profile = key
            label = f"selection {name} {dtype} ws{world_size} {profile}"
            before, after = old_bounds.get(key), new_bounds.get(key)
            if before is None or after is None:
                lines.append(f"{'+' if before is None else '-'} {label}: {'added' if before is None else 'removed'}")
                continue
            for field in spec.BOUNDARY_FIELDS:
                was, now = before["limits"].get(field), after["limits"].get(field)
                if (was, before["key"]) != (now, after["key"]):
                    lines.append(f"~ {label}: {field} {_shown_bound(was, before['key'])} -> "
                                 f"{_shown_bound(now, after['key'])}")
            if before["measured"] != after["measured"]:
                shown = [("not measured" if m is None else " to ".join(tuning.shown_limit(v, row["key"]) for v in m))
                         for m, row in ((before["measured"], before), (after["measured"], after))]
                lines.append(f"~ {label}: measured range {shown[0]} -> {shown[1]}")
            was_own, now_own = before.get("by_hidden", {}), after.get("by_hidden", {})
            for hidden in sorted(set(was_own) | set(now_own), key=int):
                was, now = was_own.get(hidden), now_own.get(hidden)
                if was != now:
                    shown = [("none of its own" if row is None else
                              " / ".join(_shown_bound(row["limits"].get(field), after["key"])
                                         for field in spec.BOUNDARY_FIELDS)
                              + " measured " + " to ".join(tuning.shown_limit(v, after["key"]) for v in row["measured"]))
                             for row in (was, now)]
                    lines.append(f"~ {label} at hidden {hidden}: {shown[0]} -> {shown[1]}")
            if before.get("source") != after.get("source"):
                lines.append(f"~ {label}: source {before.get('source')!r} -> {after.get('source')!r}")
    if old.get("selection", {}).get("ladder") not in (None, new["selection"]["ladder"]):
        lines.append(f"~ regime ladder: {json.dumps(old['selection']['ladder'])} -> "
                     f"{json.dumps(new['selection']['ladder'])}")
    if "body" in old and same_layout and _code_hash(old["body"]) != _code_hash(new["body"]):
        lines.append(f"~ kernel body {body_entry(new)} changed "
                     f"(code sha256 {_code_hash(old['body'])[:12]} -> {_code_hash(new['body'])[:12]})")
    for field, what in (("param_plan", "parameter plan"), ("targets", "targets"),
                        ("compile_options", "compile options")):
        if field in old and old[field] != new.get(field):
            lines.append(f"~ {what} changed: {json.dumps(old[field])} -> {json.dumps(new.get(field))}")
    return lines
