"""The manifest: the contract between generated/ and the runtime.

Canonical JSON (sorted keys, indent 1, ASCII, trailing newline). The runtime
reads only this and the files it lists, checking each file's sha256 and size
(moe_ar_common/manifest_reader.py) before compiling.
"""
from __future__ import annotations

import json

from moe_ar_common.manifest_reader import FORMAT, sha256_bytes

from . import abi, spec
from .enumeration import Enumeration
from .table_sets import TUNE_FORMAT, TUNE_VERSION, TableSet
from .tuning import ALL_TOKENS

# How a program is launched; the runtime computes the numbers from H, T and the
# device. One text per field, the same for every program today.
LAUNCH = {
    "threads": f"32 * ceil(H / 8 / vec_per_thread / 32), at most {abi.MAX_THREADS}",
    "vec_per_thread": (f"per call: {abi.FEW_TOKENS_VEC_PER_THREAD} for T <= {abi.FEW_TOKENS_MAX} where the row fits in "
                       f"{abi.MAX_THREADS} threads, else {abi.MAX_VEC_PER_THREAD} (the fewest threads); a workspace may "
                       f"fix one value from 1 to {abi.MAX_VEC_PER_THREAD}"),
    "grid": "persistent: min(work units, co-resident blocks on the GPU; when ranks share a GPU, a quarter of each rank's share)",
    "cluster": 1,
    "dynamic_smem": "row_stages * H * (bytes of the dtype) + 128 where row_stages > 0 (the row ring), else 0",
}


def selection_rule() -> str:
    """The ladder in words (the manifest's `selection.rule`, the selection table's comment)."""
    rungs = [f"T <= {regime.max_tokens_field}: {regime.name}" for regime in spec.LADDER[:-1]]
    return ("; ".join(rungs) + f"; else {spec.LADDER[-1].name}; then the shared-expert variant where the rank "
            "has a shared operand; a hole falls back to its fallback_family; at world size 1 (no peers) every "
            "exchange rung runs local, so a ladder may return to the latency layout after the streaming one")


def dumps(obj) -> str:
    """Canonical JSON text: sorted keys, indent 1, ASCII only, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def _file_entry(rel: str, data: bytes) -> dict:
    return {"file": rel, "sha256": sha256_bytes(data), "bytes": len(data)}


# What a cell's `key` counts, for each of generator/fit.py KEYS.
KEY_MEANINGS = {"tokens": "T, the call's token count",
                "bytes_per_rank": "T x hidden x element bytes: one rank's rows of the call"}


def selection_set(table_set: TableSet) -> dict:
    """One table set as the manifest lists it: its key (match; null for the written model), the
    stamps of its measurement files, and every cell with its key, limits, measured range and source
    (and by_hidden: {hidden: {limits, measured}} where hidden sizes have boundaries of their own)."""
    return {
        "name": table_set.name,
        "title": table_set.title,
        "match": table_set.match,
        "table": table_set.table,
        "sources": list(table_set.sources),
        "boundaries": [{"dtype": dtype, "world_size": world_size, "profile": profile, "key": cell.key,
                        "limits": cell.by_field(), "measured": None if cell.measured is None else list(cell.measured),
                        "source": cell.source,
                        # only where a hidden size has boundaries of its own (JSON keys: strings)
                        **({"by_hidden": {str(hidden): {"limits": cell.by_field(hidden), "measured": list(measured)}
                                          for hidden, _, measured in cell.by_hidden}}
                           if cell.by_hidden else {})}
                       for (dtype, world_size, profile), cell in table_set.boundaries.items()],
    }


def build(enumeration: Enumeration, sets: tuple[TableSet, ...], files: dict, code_sha256: dict,
          generated_info: dict, body: dict) -> dict:
    """files: relative path -> bytes of every other generated file.
    body: entry (the header a program includes), include_dir, headers (every body header, in the
    order a program inlines them), sources (header -> the file it comes from).
    code_sha256: program name (and body["entry"]) -> generator.code_hash.code_sha256 of what it
    compiles (for a program, its text and the headers it includes): it changes whenever compiled
    code may."""
    programs = []
    for program in sorted(enumeration.programs, key=lambda s: s.name):
        family = spec.FAMILY_BY_NAME[program.family]
        regime = spec.REGIME_BY_NAME[family.regime]
        programs.append({
            **_file_entry(program.file_name, files[program.file_name]),
            "name": program.name,
            "symbol": program.symbol,
            "cluster_symbol": program.cluster_symbol,
            "family": program.family,
            "dtype": program.dtype,
            "world_size": program.world_size,
            "profile": program.profile,
            "protocol_class": program.protocol_class,
            "base_family": program.base_family,
            "regime": regime.name,
            "shared_prefetch": family.shared_prefetch,
            "sliced_units": regime.work_unit == "slice",
            "column_units": regime.work_unit == "column",
            "outputs": ["norm_out", "residual_out", *spec.PROFILE_BY_NAME[program.profile].extra_outputs],
            "launch": LAUNCH,
            "register_cap": spec.register_cap(program.family, program.world_size, program.profile),
            "row_stages": spec.row_stages(program.family, program.profile),
            "params": "param_plan",
            "code_sha256": code_sha256[program.name],
        })
    holes = [{
        "family": h.spec.family, "dtype": h.spec.dtype, "world_size": h.spec.world_size,
        "profile": h.spec.profile, "reason": h.reason, "fallback_family": h.fallback_family,
    } for h in enumeration.holes]
    return {
        "_generated": generated_info,
        "format": FORMAT,
        "axes": {
            "dtypes": list(spec.DTYPES),
            "world_sizes": list(spec.WORLD_SIZES),
            "table_index": ["dtype", "world_size", "profile"],
            # Records in table order; program names spell a family and a profile by their names.
            "output_profiles": [{"name": p.name, "quant": p.quant, "meaning": p.meaning,
                                 "outputs": ["norm_out", "residual_out", *p.extra_outputs]}
                                for p in spec.PROFILE_BY_NAME.values()],
            # world_sizes: the family's space (world size 1 for the local families, the others for the
            # exchanges); its programs and holes are cells of these world sizes only.
            "families": [{"name": f.name, "title": f.title, "meaning": f.meaning, "base": f.base,
                          "protocol": f.protocol, "regime": f.regime, "shared_prefetch": f.shared_prefetch,
                          "world_sizes": list(spec.world_sizes_of(f.name))}
                         for f in spec.FAMILY_BY_NAME.values()],
        },
        # The kernel body: a program's `#include "name"` lines are replaced by include_dir/name,
        # recursively (manifest_reader.source_for); headers in that order.
        "body": {
            "entry": body["entry"],
            "include_dir": body["include_dir"],
            "headers": [{**_file_entry(rel, files[rel]), "source": body["sources"][rel]} for rel in body["headers"]],
            "code_sha256": code_sha256[body["entry"]],
        },
        "param_plan": [[name, ctype, ctypes] for name, ctype, ctypes, _ in abi.PARAMS],
        # Words and bits the kernels and the runtime share (params.cuh renders the same enums).
        "constants": abi.shared_enums(),
        "limits": {
            "max_world_size": abi.MAX_WORLD_SIZE,
            "max_threads": abi.MAX_THREADS,
            "max_vec_per_thread": abi.MAX_VEC_PER_THREAD,
            "max_hidden": abi.MAX_HIDDEN,
            "few_tokens_max": abi.FEW_TOKENS_MAX,
            "few_tokens_vec_per_thread": abi.FEW_TOKENS_VEC_PER_THREAD,
            "cluster_max_tokens": abi.CLUSTER_MAX_TOKENS,
            "cluster_small_row_max_tokens": abi.CLUSTER_SMALL_ROW_MAX_TOKENS,
            "cluster_small_row_many_routes_max_tokens": abi.CLUSTER_SMALL_ROW_MANY_ROUTES_MAX_TOKENS,
            "cluster_many_routes_top_k": abi.CLUSTER_MANY_ROUTES_TOP_K,
            "cluster_max_blocks": abi.CLUSTER_MAX_BLOCKS,
            "cluster_min_warps": abi.CLUSTER_MIN_WARPS,
            "cluster_round_min_warps": abi.CLUSTER_ROUND_MIN_WARPS,
        },
        "targets": list(spec.ARCH_TARGETS),
        "compile_options": list(spec.COMPILE_OPTIONS),
        "selection": {
            "rule": selection_rule(),
            # The regime ladder: a call runs the first regime whose boundary field's value T does
            # not exceed (null: the last rung, every larger T).
            "ladder": [[regime.name, regime.max_tokens_field] for regime in spec.LADDER],
            # A world without peers exchanges nothing: there every exchange rung runs this family.
            "no_peers": {"world_size": spec.LOCAL_WORLD_SIZE, "family": spec.LOCAL_FAMILY},
            "all_tokens": ALL_TOKENS,
            "keys": KEY_MEANINGS,
            # what `gen-programs tune` writes, which the runtime reads (a user's table set)
            "tune_file": {"format": TUNE_FORMAT, "version": TUNE_VERSION},
            # The committed sets, then the written model (match null): the runtime takes the set for
            # its device (dispatch/table_sets.py), and the model where none matches.
            "sets": [selection_set(table_set) for table_set in sets],
        },
        "programs": programs,
        "holes": holes,
        "files": {rel: {"sha256": sha256_bytes(data), "bytes": len(data)} for rel, data in sorted(files.items())},
    }
