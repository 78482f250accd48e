"""`gen-programs diff REV`: what changed in the tables since a git revision.

Compares two manifests cell by cell (family x dtype x world size x profile):
a program that appeared or vanished, programs whose compiled code changed
(code_sha256: its tokens and those of the body headers it includes, comments and
layout aside), one line per cause (the headers whose code changed, the program's own
file), and selection boundaries that moved. Also whole-table facts: body layout,
parameter plan, targets; a summary line closes the list. The revision's code hashes are computed afresh from its
files, so a change in how the hash is defined never shows as a code change. A
revision whose body is split into other files (manifest format 2 had one body
file) hashes other texts: the diff then says so instead of comparing programs.
"""
from __future__ import annotations

import json
import subprocess

from moe_ar_common.manifest_reader import ManifestError, inline_includes, load_verified_manifest

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


def code_files(manifest: dict) -> list[str]:
    """The generated-relative files code hashes are computed from: the body's, then every program's."""
    return [*body_files(manifest), *(entry["file"] for entry in manifest["programs"])] if "body" in manifest else []


def with_code_hashes(manifest: dict, files: dict[str, bytes]) -> dict:
    """The manifest with its code hashes computed from `files` ({generated-relative path: bytes}) as
    generator/render.py does today: each program's (its text, then the text of each body file it
    includes, inlined as manifest_reader.source_for does), and, to name what changed, each body
    header's (header code_sha256), each program's own text's (text_code_sha256) and its includes."""
    body = manifest.get("body")
    if body is None:
        return manifest
    headers = body_files(manifest)
    include_dir = body.get("include_dir", headers[0].rsplit("/", 1)[0])
    texts = {rel: files[rel].decode("utf-8") for rel in headers if rel in files}
    if len(texts) != len(headers):
        return manifest

    def read(rel: str, including: str) -> str:
        if rel not in texts:
            raise ManifestError(f"{including} includes {rel}, which is not a body file")
        return texts[rel]

    body["code_sha256"] = code_sha256(*(texts[rel] for rel in headers))
    for header in body.get("headers", []):
        header["code_sha256"] = code_sha256(texts[header["file"]])
    for entry in manifest["programs"]:
        text = files.get(entry["file"])
        if text is None:
            continue
        text = text.decode("utf-8")
        try:
            included = inline_includes(text, entry["file"], include_dir, read)[1]
        except ManifestError:
            continue  # not a tree this generator can read: its recorded hash stays
        entry["code_sha256"] = code_sha256(text, *(texts[rel] for rel in included))
        entry["text_code_sha256"] = code_sha256(text)
        entry["includes"] = list(included)
        today = _name_today(entry)
        if today not in (None, entry["name"]):  # renamed since: its hash as if it had today's name
            entry["code_sha256_as_named_today"] = code_sha256(text.replace(entry["name"], today),
                                                              *(texts[rel] for rel in included))
    return manifest


def manifest_in(generated) -> dict:
    """The verified manifest of a generated tree on disk, with the code hashes diff_manifests names
    causes by (with_code_hashes)."""
    manifest = load_verified_manifest(generated)
    files = {rel: (generated / rel).read_bytes() for rel in code_files(manifest)}
    return with_code_hashes(manifest, files)


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
    generated = path.rsplit("/", 1)[0]
    files = _git_files(rev, root, [f"{generated}/{rel}" for rel in code_files(manifest)])
    return with_code_hashes(manifest, {name.removeprefix(f"{generated}/"): data for name, data in files.items()})


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


PROGRAM_FILE = "the program file (templates/program.cu.j2)"


def _header_codes(old: dict, new: dict) -> tuple[dict[str, str], dict[str, str]]:
    """{body header: its code hash} of both manifests where both have them (with_code_hashes), else
    {body header: the hash of its bytes}."""
    headers = [[h for h in m.get("body", {}).get("headers", [])] for m in (old, new)]
    key = "code_sha256" if all("code_sha256" in h for h in headers[0] + headers[1]) else "sha256"
    return tuple({h["file"]: h[key] for h in each} for each in headers)


def _cause(old: dict, new: dict, before: dict, after: dict) -> str:
    """What changed a program's code: the body headers it includes whose code changed, and its own file."""
    was, now = _header_codes(old, new)
    headers = [rel for rel in after.get("includes", now) if was.get(rel) != now[rel]]
    if "text_code_sha256" in before and "text_code_sha256" in after:
        own = before["text_code_sha256"] != after["text_code_sha256"]
    else:  # hashes that do not tell the program's own text apart: blame it where no header changed
        own = not headers
    return " and ".join([", ".join(headers)] * bool(headers) + [PROGRAM_FILE] * own)


def _counted(programs: list[dict]) -> str:
    """A few programs by name, more by family: '2 programs: a, b' or '156 programs (local 8, ...)'."""
    noun = "program" if len(programs) == 1 else "programs"
    if len(programs) <= 4:
        return f"{len(programs)} {noun}: {', '.join(p['name'] for p in programs)}"
    families: dict[str, int] = {}
    for p in programs:
        families[p["family"]] = families.get(p["family"], 0) + 1
    return f"{len(programs)} {noun} ({', '.join(f'{family} {n}' for family, n in families.items())})"


def summary(counts: dict[str, int]) -> str:
    """The closing line of a diff: how many of each kind of change ({s} in a kind: its plural's s)."""
    return "summary: " + ", ".join(f"{n} {what.format(s='' if n == 1 else 's')}" for what, n in counts.items() if n)


def diff_manifests(old: dict | None, new: dict) -> list[str]:
    """Human-readable change lines, old -> new, closed by a summary line; empty when nothing changed."""
    old = old or {"programs": [], "holes": [], "selection": {"boundaries": []}}
    lines = []
    counts = dict.fromkeys(("program{s} appeared", "program{s} vanished", "program{s} renamed",
                            "program{s} changed code", "hole{s} changed", "hole{s} gone", "hole{s} added",
                            "selection set{s} added",
                            "selection set{s} removed", "selection cell{s} changed", "table-wide change{s}"), 0)
    changed_code: dict[str, list[dict]] = {}  # cause -> the programs it changed
    # Code hashes cover the texts of the body's files, so they compare only within one split of the body.
    same_layout = "body" not in old or body_files(old) == body_files(new)
    if not same_layout:
        before, after = body_files(old), body_files(new)
        counts["table-wide change{s}"] += 1
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
            counts["program{s} appeared"] += 1
            lines.append(f"+ {_label(key)}: appeared, {after['name']}{why}")
        elif after is None:
            hole = new_holes.get(key)
            why = f" (now a hole -> {hole['fallback_family'] or 'none'}: {hole['reason']})" if hole else ""
            counts["program{s} vanished"] += 1
            lines.append(f"- {_label(key)}: vanished, {before['name']}{why}")
        elif before["name"] != after["name"]:
            same = same_layout and before.get("code_sha256_as_named_today") == _code_hash(after)
            counts["program{s} renamed"] += 1
            lines.append(f"~ {_label(key)}: renamed {before['name']} -> {after['name']}, "
                         + ("same code but the name" if same else
                            f"code sha256 {_code_hash(before)[:12]} -> {_code_hash(after)[:12]}"))
        elif same_layout and _code_hash(before) != _code_hash(after):
            changed_code.setdefault(_cause(old, new, before, after), []).append(after)
    for cause, programs in changed_code.items():
        counts["program{s} changed code"] += len(programs)
        lines.append(f"~ {cause} changed: {_counted(programs)}")
    for key in sorted(set(old_holes) & set(new_holes)):
        before, after = old_holes[key], new_holes[key]
        if (before["reason"], before["fallback_family"]) != (after["reason"], after["fallback_family"]):
            counts["hole{s} changed"] += 1
            lines.append(f"~ {_label(key)}: hole now falls back to {after['fallback_family']} ({after['reason']}), "
                         f"was {before['fallback_family']} ({before['reason']})")
    # Holes that left the tables (or came) without a program taking their cell, by family: cells that
    # are no longer (or are now) a family's cells, such as the world-size-1 line before it split the spaces.
    for sign, keys, what in (("-", [k for k in old_holes if k not in new_holes and k not in new_programs], "gone"),
                             ("+", [k for k in new_holes if k not in old_holes and k not in old_programs], "added")):
        by_family: dict[str, list[tuple]] = {}
        for key in sorted(keys):
            by_family.setdefault(key[0], []).append(key)
        for family, cells in by_family.items():
            sizes = "/".join(str(w) for w in sorted({w for _, _, w, _ in cells}))
            counts[f"hole{{s}} {what}"] += len(cells)
            lines.append(f"{sign} {family}: {len(cells)} hole{'s' if len(cells) > 1 else ''} {what} at world "
                         f"size{'s' if '/' in sizes else ''} {sizes} ("
                         + ("no longer cells of the family)" if what == "gone" else "new cells of the family)"))

    old_sets, new_sets = selection_sets(old), selection_sets(new)
    for name in sorted(set(old_sets) - set(new_sets)):
        counts["selection set{s} removed"] += 1
        lines.append(f"- selection set {name}: removed ({len(old_sets[name])} cells)")
    for name in sorted(set(new_sets) - set(old_sets)):
        counts["selection set{s} added"] += 1
        lines.append(f"+ selection set {name}: added ({len(new_sets[name])} cells)")
    for name in sorted(set(old_sets) & set(new_sets)):
        old_bounds, new_bounds = old_sets[name], new_sets[name]
        for key in sorted(set(old_bounds) | set(new_bounds)):
            cell_start = len(lines)
            dtype, world_size, profile = key
            label = f"selection {name} {dtype} ws{world_size} {profile}"
            before, after = old_bounds.get(key), new_bounds.get(key)
            if before is None or after is None:
                lines.append(f"{'+' if before is None else '-'} {label}: {'added' if before is None else 'removed'}")
                counts["selection cell{s} changed"] += 1
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
            counts["selection cell{s} changed"] += len(lines) > cell_start
    table_wide_start = len(lines)
    if old.get("selection", {}).get("no_peers") != new["selection"].get("no_peers"):
        rules = (old.get("selection", {}).get("no_peers"), new["selection"].get("no_peers"))
        shown = [("absent" if rule is None else
                  f"world size {rule['world_size']} runs {rule['family']} for every exchange rung") for rule in rules]
        lines.append(f"~ selection without peers: {shown[0]} -> {shown[1]}")
    if old.get("selection", {}).get("ladder") not in (None, new["selection"]["ladder"]):
        lines.append(f"~ regime ladder: {json.dumps(old['selection']['ladder'])} -> "
                     f"{json.dumps(new['selection']['ladder'])}")
    for field, what in (("param_plan", "parameter plan"), ("targets", "targets"),
                        ("compile_options", "compile options")):
        if field in old and old[field] != new.get(field):
            lines.append(f"~ {what} changed: {json.dumps(old[field])} -> {json.dumps(new.get(field))}")
    counts["table-wide change{s}"] += len(lines) - table_wide_start
    return [*lines, summary(counts)] if lines else []
