"""`gen-programs diff REV`: what changed in the tables since a git revision.

Compares two manifests cell by cell (family x dtype x world size x profile):
a program that appeared or vanished, a program whose compiled code changed
(code_sha256, or the file's sha256 for manifests without it), and selection
boundaries that moved. Also whole-table facts: body, parameter plan, targets.
"""
from __future__ import annotations

import json
import subprocess

from . import spec, tuning


def manifest_at(rev: str, root, path: str = "generated/manifest.json") -> dict | None:
    """The manifest committed at `rev`, or None where that revision has none."""
    try:
        subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=root,
                       check=True, capture_output=True)
    except subprocess.CalledProcessError:
        raise ValueError(f"{rev!r} is not a git revision here") from None
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True)
    if shown.returncode != 0:
        return None
    return json.loads(shown.stdout)


def _cell_key(entry: dict) -> tuple:
    return (entry["family"], entry["dtype"], entry["world_size"], entry["profile"])


def _label(key: tuple) -> str:
    family, dtype, ws, profile = key
    return f"{family} {dtype} ws{ws} {spec.profile_tag(profile)}"


def _code_hash(entry: dict) -> str:
    return entry.get("code_sha256", entry["sha256"])


def diff_manifests(old: dict | None, new: dict) -> list[str]:
    """Human-readable change lines, old -> new; empty when nothing changed."""
    old = old or {"programs": [], "holes": [], "selection": {"boundaries": []}}
    lines = []
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
            why = f" (now a hole -> {hole['fallback_family']}: {hole['reason']})" if hole else ""
            lines.append(f"- {_label(key)}: vanished, {before['name']}{why}")
        elif _code_hash(before) != _code_hash(after) or before["name"] != after["name"]:
            lines.append(f"~ {_label(key)}: program changed, {after['name']} "
                         f"code sha256 {_code_hash(before)[:12]} -> {_code_hash(after)[:12]}")
    for key in sorted(set(old_holes) & set(new_holes)):
        a, b = old_holes[key], new_holes[key]
        if (a["reason"], a["fallback_family"]) != (b["reason"], b["fallback_family"]):
            lines.append(f"~ {_label(key)}: hole now falls back to {b['fallback_family']} ({b['reason']}), "
                         f"was {a['fallback_family']} ({a['reason']})")

    def bounds(m):
        return {(b["dtype"], b["world_size"], b["profile"]): b for b in m["selection"]["boundaries"]}

    old_b, new_b = bounds(old), bounds(new)
    for key in sorted(set(old_b) | set(new_b)):
        dtype, ws, profile = key
        label = f"selection {dtype} ws{ws} {spec.profile_tag(profile)}"
        a, b = old_b.get(key), new_b.get(key)
        if a is None or b is None:
            lines.append(f"{'+' if a is None else '-'} {label}: {'added' if a is None else 'removed'}")
            continue
        def shown(value):  # a manifest from before a field existed has none
            return "absent" if value is None else "all" if value == tuning.ALL_TOKENS else value
        for field in ("oneshot_max_tokens", "early_max_tokens", "twoshot_max_tokens", "loads_max_tokens"):
            if a.get(field) != b.get(field):
                lines.append(f"~ {label}: {field} {shown(a.get(field))} -> {shown(b.get(field))}")
    if old.get("selection", {}).get("source") not in (None, new["selection"]["source"]):
        lines.append(f"~ selection source: {old['selection']['source']} -> {new['selection']['source']}")
    if "body" in old and _code_hash(old["body"]) != _code_hash(new["body"]):
        lines.append(f"~ kernel body {new['body']['file']} changed "
                     f"(code sha256 {_code_hash(old['body'])[:12]} -> {_code_hash(new['body'])[:12]})")
    for field, what in (("param_plan", "parameter plan"), ("targets", "targets"),
                        ("compile_options", "compile options")):
        if field in old and old[field] != new.get(field):
            lines.append(f"~ {what} changed: {json.dumps(old[field])} -> {json.dumps(new.get(field))}")
    return lines
