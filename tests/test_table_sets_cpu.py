"""The runtime's choice of selection boundaries (dispatch/table_sets.py), without a GPU: the set for
the device and every fallback, a user's own set and its refusal, the override, the query, and that
the choice is made when the workspace is built, never per call."""
from __future__ import annotations

import json
import logging
import types
import warnings

import pytest
import torch

import dispatch
from generator import spec
from dispatch import gpu_facts, registry, rendezvous, table_sets, workspace
from dispatch.rendezvous import program_set_sha256

ALL = registry.program_set().all_tokens
FIELDS = table_sets.ladder_fields()
H200 = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink")
H100_SXM = gpu_facts.DeviceKey("NVIDIA H100 80GB HBM3", "9.0", 132, "nvlink")
H100_PCIE = gpu_facts.DeviceKey("NVIDIA H100 PCIe", "9.0", 114, "none")
B200 = gpu_facts.DeviceKey("NVIDIA B200", "10.0", 148, "nvlink")
ROW = 7168 * 2  # bytes of one bf16 row of hidden 7168
ONESHOT = FIELDS.index("oneshot_max_tokens")


def from_oneshot(value) -> tuple:
    """Every boundary from the one-shot's on at `value`; a rung before it ends at 0."""
    return (0,) * ONESHOT + (value,) * (len(FIELDS) - ONESHOT)


def _resolve(device=H200, world_size=2, hidden=7168, user=None, boundaries=None, sha=None, dtype="bf16"):
    return table_sets.resolve(dtype=dtype, world_size=world_size, hidden=hidden, elem_bytes=2, device=device,
                              user=user, program_set_sha256=sha or program_set_sha256(), boundaries=boundaries)


def _committed_cell(profile="plain", world_size=2):
    sets, _ = table_sets.committed_sets()
    return sets[0].cells[("bf16", world_size, profile)]


# ---- the committed sets and the chain -----------------------------------------------------------

def test_the_manifest_lists_the_committed_sets_then_the_model():
    sets, model = table_sets.committed_sets()
    assert [s.name for s in sets] == ["h200_nvlink"] and model.name == "model" and model.match is None
    assert sets[0].match == {"product": "NVIDIA H200", "capability": "9.0", "interconnect": "nvlink"}
    assert set(sets[0].cells) == set(model.cells)
    assert all(cell.key == "tokens" and cell.measured is None for cell in model.cells.values())
    cell = _committed_cell()
    assert cell.key == "bytes_per_rank" and cell.measured == (4096 * 2, 16384 * ROW)


@pytest.mark.parametrize("device,name,why", [
    (H200, "h200_nvlink", "exact product"),
    (H200.__class__(H200.product, "9.0", 132, "unknown"), "h200_nvlink", "exact product"),  # no NVML: not held against it
    (H100_SXM, "h200_nvlink", "same compute capability and interconnect"),
    (H100_PCIE, "model", "no committed set matches"),
    (B200, "model", "no committed set matches"),
    (gpu_facts.UNKNOWN_DEVICE, "model", "no committed set matches"),
])
def test_the_set_for_a_device_exact_product_then_capability_and_interconnect_then_the_model(device, name, why):
    table_set, reason = table_sets.committed_for(device)
    assert (table_set.name, reason) == (name, why)
    selection = _resolve(device)
    assert (selection.set, selection.why) == (name, why)
    assert {cell.set for cell in selection.cells.values()} == {name}


def test_a_bytes_per_rank_cell_is_served_in_tokens_of_the_workspaces_row():
    cell = _committed_cell()
    plain = _resolve().limits("plain")
    assert plain["oneshot_max_tokens"] == cell.limits[spec.BOUNDARY_FIELDS.index("oneshot_max_tokens")] // ROW == 292
    # a row half as long: twice the tokens (4 MiB a rank either way)
    assert _resolve(hidden=3584).limits("plain")["oneshot_max_tokens"] == cell.limits[spec.BOUNDARY_FIELDS.index("oneshot_max_tokens")] // (3584 * 2) == 585
    # the written model is in tokens, whatever the row
    assert _resolve(world_size=4).limits("plain") == _resolve(world_size=4, hidden=1024).limits("plain") == \
        dict(zip(FIELDS, table_sets.committed_sets()[1].cells[("bf16", 4, "plain")].limits))
    source = _resolve().cells["plain"].source
    assert source.startswith("measured in bench_results/") and source.endswith("; T outside 1..16384 from model")


def test_outside_its_measured_range_a_cell_runs_what_the_next_set_runs():
    """compose(): inside the range the cell's own rungs; above it never a rung earlier than at its end
    and otherwise the fallback's; below it never a later rung than at its start."""
    fallback = (64, 512, ALL, ALL)
    # measured 100..1000 tokens: one-shot to 200, then the pipelined two-shot (the last rung)
    assert table_sets.compose((200, 200, 200, 200), (100, 1000), fallback, ALL) == (200, 200, 200, 200)
    # the one-shot to the end of the range: above it the fallback's rung (the two-shot), not the one-shot
    assert table_sets.compose((ALL, ALL, ALL, ALL), (1, 512), fallback, ALL) == (512, 512, ALL, ALL)
    # measured from 256 to 4096, the early two-shot there: below it no later rung than that (the
    # fallback's one-shot to 64), above it no earlier (the fallback's two-shot)
    assert table_sets.compose((0, ALL, ALL, ALL), (256, 4096), fallback, ALL) == (64, 4096, ALL, ALL)
    # a range with no token count of this row: the fallback throughout
    assert table_sets.compose((0, 0, 0, 0), (5, 4), fallback, ALL) == fallback
    # every T agrees with the rule, point by point
    limits, measured = (16, 300, 300, 700), (8, 1000)
    composed = table_sets.compose(limits, measured, fallback, ALL)
    for T in range(1, 3000):
        if T < measured[0]:
            want = min(table_sets.rung_of(limits, measured[0]), table_sets.rung_of(fallback, T))
        elif T > measured[1]:
            want = max(table_sets.rung_of(limits, measured[1]), table_sets.rung_of(fallback, T))
        else:
            want = table_sets.rung_of(limits, T)
        assert table_sets.rung_of(composed, T) == want, T


def test_a_bytes_range_holding_no_token_count_leaves_the_cell_to_the_fallback():
    cell = table_sets.Cell("bytes_per_rank", (ALL,) * len(FIELDS), (1000, 2000), "measured")
    limits, measured = table_sets.token_cell(cell, 7168, 2, ALL)
    assert measured == (1, 0)  # no T of a 14336-byte row lies in 1000..2000 bytes
    assert table_sets.compose(limits, measured, (64, 512, ALL, ALL), ALL) == (64, 512, ALL, ALL)


# ---- a user's own set -----------------------------------------------------------------------------

def _user_doc(match=None, sha=None, cells=None, name="tuned here", by_hidden=None):
    match = match or {"product": "NVIDIA H200", "capability": "9.0", "sm_count": 132, "interconnect": "nvlink"}
    cells = cells if cells is not None else {("bf16", 2, "plain"): (from_oneshot(1024 * ROW), (ROW, 2048 * ROW))}
    rows = [{"dtype": d, "world_size": w, "profile": p, "key": "bytes_per_rank",
             "limits": dict(zip(FIELDS, limits)), "measured": list(measured), "source": "measured here",
             **({"by_hidden": {str(h): {"limits": dict(zip(FIELDS, own)), "measured": list(own_measured)}
                               for h, (own, own_measured) in by_hidden.items()}} if by_hidden else {})}
            for (d, w, p), (limits, measured) in cells.items()]
    return {"format": table_sets.tune_format()[0], "version": table_sets.tune_format()[1], "stamp": {},
            "set": {"name": name, "match": match, "program_set_sha256": sha or program_set_sha256(),
                    "boundaries": rows}}


def _user_file(tmp_path, **kw):
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(_user_doc(**kw)))
    return path


def test_a_users_set_serves_the_cells_it_measured_and_the_chain_the_rest(tmp_path):
    user = table_sets.read_user_set(_user_file(tmp_path), "tables")
    selection = _resolve(user=user)
    assert selection.set == "tuned here" and selection.user_set == str(tmp_path / "tables.json")
    assert selection.cells["plain"].set == "tuned here"
    assert selection.limits("plain") == dict(zip(FIELDS, from_oneshot(1024)))  # its one-shot to 1024, then the pipelined
    assert selection.cells["nvfp4"].set == "h200_nvlink"  # a cell it lacks: the committed set
    assert selection.limits("nvfp4") == _resolve().limits("nvfp4")
    assert _resolve(user=user, world_size=4).cells["plain"].set == "h200_nvlink"


@pytest.mark.parametrize("change,names", [
    (dict(match={"product": "NVIDIA H100 80GB HBM3", "capability": "9.0", "sm_count": 132, "interconnect": "nvlink"}),
     "product 'NVIDIA H100 80GB HBM3', this device has 'NVIDIA H200'"),
    (dict(match={"product": "NVIDIA H200", "capability": "9.0", "sm_count": 66, "interconnect": "nvlink"}),
     "sm_count 66, this device has 132"),
    (dict(match={"product": "NVIDIA H200", "capability": "9.0", "sm_count": 132, "interconnect": "none"}),
     "interconnect 'none', this device has 'nvlink'"),
    (dict(sha="f" * 64), "measured with other programs (manifest sha256 ffffffffffffffff..."),
])
def test_a_users_set_that_does_not_match_is_refused_with_one_warning_and_not_used(tmp_path, change, names):
    user = table_sets.read_user_set(_user_file(tmp_path, **change), "tables")
    table_sets._said.clear()
    with pytest.warns(RuntimeWarning) as caught:
        first = _resolve(user=user)
        second = _resolve(user=user)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith("tables: the table set 'tuned here' from ") and names in message, message
    for selection in (first, second):  # never half-used: every cell from the device's committed set
        assert selection.set == "h200_nvlink" and selection.user_set is None
        assert {cell.set for cell in selection.cells.values()} == {"h200_nvlink"}


def test_a_hidden_size_with_boundaries_of_its_own_is_served_by_them(tmp_path):
    """A cell whose row for hidden 4096 differs: a workspace of that hidden size takes it and its
    measured range (and says so), every other hidden size the cell's own; both in bytes per rank."""
    own = from_oneshot(256 * 4096 * 2)
    user = table_sets.read_user_set(_user_file(tmp_path, by_hidden={4096: (own, (4096 * 2, 512 * 4096 * 2))}),
                                    "tables")
    at_4096 = _resolve(user=user, hidden=4096)
    assert at_4096.limits("plain")["oneshot_max_tokens"] == 256
    assert "this hidden size's own boundaries (4096); T outside 1..512 from h200_nvlink" in at_4096.cells["plain"].source
    at_7168 = _resolve(user=user)
    assert at_7168.limits("plain") == dict(zip(FIELDS, from_oneshot(1024)))
    assert "own boundaries" not in at_7168.cells["plain"].source
    assert _resolve(user=user, hidden=3584).limits("plain")["oneshot_max_tokens"] == 2048  # 1024 rows of 7168 in bytes
    assert at_4096.label != _resolve(user=user, hidden=4096 + 128).label


def test_the_committed_world_one_cells_end_the_latency_layout_where_its_grid_leaves_one_wave():
    """The H200 set fitted world size 1 at H 7168, 4096 and 2048, 136 and 144 tokens measured too: the
    latency layout (one block a token, a block a multiprocessor at H 7168) up to 1.75 MiB a rank, 128
    tokens of H 7168, where its grid is one wave of the 132 multiprocessors; H 4096 keeps its own 2 MiB
    (256 tokens: two of its blocks fit a multiprocessor), and so does H 2048 for plain and FP8
    group-128 (512 tokens; the latency program measured faster there than the streaming one); the
    streaming layout above, every profile (bench_results/tuning/README.md, "World size 1")."""
    local, streaming = FIELDS.index("local_max_tokens"), FIELDS.index("streaming_max_tokens")
    for profile in ("plain", "nvfp4", "fp8_tensor", "fp8_group128"):
        cell = _committed_cell(profile, world_size=1)
        assert cell.limits[local] == 128 * ROW and cell.limits[streaming] == ALL, profile
        assert set(cell.by_hidden) == ({2048, 4096} if profile in ("plain", "fp8_group128") else {4096}), profile
    for profile in ("plain", "fp8_group128"):
        at_2048 = _resolve(world_size=1, hidden=2048).limits(profile)
        assert (at_2048["local_max_tokens"], at_2048["streaming_max_tokens"]) == (512, ALL), profile
    assert _resolve(world_size=1, hidden=2048).limits("nvfp4")["local_max_tokens"] == 128 * ROW // (2048 * 2)
    at_7168, at_4096 = _resolve(world_size=1).limits("plain"), _resolve(world_size=1, hidden=4096).limits("plain")
    assert at_7168["local_max_tokens"] == 128 and at_7168["streaming_max_tokens"] == ALL
    assert (at_4096["local_max_tokens"], at_4096["streaming_max_tokens"]) == (256, ALL)
    group_7168 = _resolve(world_size=1).limits("fp8_group128")
    group_4096 = _resolve(world_size=1, hidden=4096).limits("fp8_group128")
    for hidden, profile, bounds, want in (
            (7168, "plain", at_7168, {1: "local", 128: "local", 129: "local_streaming", 136: "local_streaming",
                                      16384: "local_streaming"}),
            (4096, "plain", at_4096, {1: "local", 256: "local", 257: "local_streaming", 16384: "local_streaming"}),
            (7168, "fp8_group128", group_7168, {1: "local", 128: "local", 129: "local_streaming",
                                                16384: "local_streaming"}),
            (4096, "fp8_group128", group_4096, {1: "local", 256: "local", 257: "local_streaming",
                                                16384: "local_streaming"})):
        for T, runs in want.items():
            family = registry.select_family("bf16", 1, profile, T, False, 0, bounds=bounds)
            assert registry.program_for(family, "bf16", 1, profile) == f"moe_ar_{runs}_bf16_ws1_{profile}", (hidden, T)
    # a hidden size nobody measured takes the joint boundaries: 1.75 MiB, then the streaming layout, no return
    at_5120 = _resolve(world_size=1, hidden=5120).limits("plain")
    assert at_5120["local_max_tokens"] == 128 * ROW // (5120 * 2) and at_5120["streaming_max_tokens"] == ALL


@pytest.mark.parametrize("by_hidden", [{0: (from_oneshot(5), (1, 2))}, {4096: ((9, 3, 3, 3, 3, 3), (1, 2))},
                                       {4096: ((1, 2), (1, 2))}, {4096: (from_oneshot(5), (3, 2))},
                                       {4096: (from_oneshot(5), (1,))}])
def test_a_bad_row_of_a_hidden_size_is_refused(tmp_path, by_hidden):
    path = _user_file(tmp_path, by_hidden=by_hidden)
    with pytest.raises(ValueError, match="^tables: .*not a table set's boundaries"):
        table_sets.check_arguments(path, None)


@pytest.mark.parametrize("by_hidden", [[4096], {"4096": [1, 2]}, {"abc": {}}, {"4096": {"limits": {}, "measured": [1, 2]}}])
def test_a_by_hidden_that_is_not_rows_is_refused(tmp_path, by_hidden):
    doc = _user_doc()
    doc["set"]["boundaries"][0]["by_hidden"] = by_hidden
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="^tables: .*not a table set's boundaries"):
        table_sets.check_arguments(path, None)


def test_a_world_of_one_takes_its_products_tables_whatever_the_interconnect(tmp_path):
    """World size 1 exchanges nothing, so the interconnect does not decide its tables: an H200 whose
    NVML reports no NVLink (the one-GPU machine the world-size-1 cells were measured on) takes the
    H200 set's world-size-1 cells, committed or a user's; with peers the interconnect still counts."""
    lone = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "none")
    alone = _resolve(device=lone, world_size=1)
    assert (alone.set, alone.why) == ("h200_nvlink", "exact product")
    assert "h200-ws1" in alone.cells["plain"].source and alone.limits("plain")["local_max_tokens"] == 128
    assert alone.device == lone
    assert _resolve(device=lone, world_size=2).set != "h200_nvlink"
    cells = {("bf16", 1, "plain"): ((4 * ROW, ALL) + (ALL,) * (len(FIELDS) - 2), (ROW, 2048 * ROW))}
    user = table_sets.read_user_set(_user_file(tmp_path, cells=cells), "tables")  # tuned with NVLink up
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mine = _resolve(device=lone, world_size=1, user=user)
    assert mine.set == "tuned here" and mine.limits("plain")["local_max_tokens"] == 4


def test_an_unknown_interconnect_is_not_a_mismatch(tmp_path):
    user = table_sets.read_user_set(_user_file(tmp_path), "tables")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selection = _resolve(device=gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "unknown"), user=user)
    assert selection.set == "tuned here"


@pytest.mark.parametrize("text,says", [
    (None, "cannot read a table set"),
    ("not json", "cannot read a table set"),
    (json.dumps({"format": "something else"}), "is not a table set of format"),
    (json.dumps({**_user_doc(), "version": 99}), "is not a table set of format"),
    (json.dumps({**_user_doc(), "set": {"name": "x"}}), "has no complete `set`"),
    (json.dumps(_user_doc(cells={("bf16", 2, "plain"): ((9, 3, 3, 3), (1, 2))})), "not a table set's boundaries"),
])
def test_an_unreadable_users_set_is_a_value_error_naming_the_argument(tmp_path, monkeypatch, text, says):
    path = tmp_path / "tables.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=f"^tables: .*{says}"):
        table_sets.check_arguments(path, None)
    monkeypatch.setenv(table_sets.ENV_VAR, str(path))
    with pytest.raises(ValueError, match=f"^{table_sets.ENV_VAR}: .*{says}"):
        table_sets.check_arguments(None, None)
    with pytest.raises(ValueError, match="^tables: expected a path"):
        table_sets.check_arguments(3, None)


# ---- the override -------------------------------------------------------------------------------

@pytest.mark.parametrize("boundaries,says", [
    ([("oneshot_max_tokens", 8)], "expected a dict"),
    ({"oneshot_max_bytes": 8}, "unknown field 'oneshot_max_bytes'"),
    ({"oneshot_max_tokens": 8.0}, "oneshot_max_tokens = 8.0, expected an int"),
    ({"oneshot_max_tokens": True}, "oneshot_max_tokens = True, expected an int"),
    ({"oneshot_max_tokens": -1}, "oneshot_max_tokens = -1, expected an int"),
    ({"oneshot_max_tokens": ALL + 1}, "expected an int token count in 0.."),
    ({"oneshot_max_tokens": 64, "early_max_tokens": 8}, "oneshot_max_tokens = 64 > early_max_tokens = 8"),
])
def test_a_bad_override_is_a_value_error_naming_boundaries(boundaries, says):
    with pytest.raises(ValueError, match=f"^boundaries: .*{says}"):
        table_sets.check_arguments(None, boundaries)


def test_the_override_pins_its_fields_and_clamps_the_others():
    selection = _resolve(boundaries={"oneshot_max_tokens": 128})
    for profile, cell in selection.cells.items():
        limits = selection.limits(profile)
        assert limits["oneshot_max_tokens"] == 128 and list(limits.values()) == sorted(limits.values())
        assert "pinned by boundaries= (oneshot_max_tokens 128)" in cell.source
    # below the set's one-shot boundary (292 tokens): the later rungs keep theirs
    assert selection.limits("plain") == dict(zip(FIELDS, (0,) * ONESHOT + (128,) + (292,) * (len(FIELDS) - ONESHOT - 1)))
    # above the set's other boundaries: they move up with it
    assert _resolve(boundaries={"oneshot_max_tokens": 4096}).limits("plain") == dict(zip(FIELDS, from_oneshot(4096)))
    # every field pinned: exactly the override, whatever the device
    pinned = dict(zip(FIELDS, range(8, 8 * (len(FIELDS) + 1), 8)))
    for device in (H200, B200):
        assert _resolve(device, boundaries=pinned).limits("nvfp4") == pinned
    limits = tuple(10 * (i + 1) for i in range(len(FIELDS)))  # 10, 20, 30, ...
    early = FIELDS.index("early_max_tokens")
    assert table_sets.pin(limits, {"early_max_tokens": 5}, FIELDS) == (
        tuple(min(v, 5) for v in limits[:early]) + (5,) + limits[early + 1:])
    assert table_sets.pin(limits, {"early_max_tokens": 10 * len(FIELDS) + 5}, FIELDS) == (
        limits[:early] + (10 * len(FIELDS) + 5,) * (len(FIELDS) - early))


# ---- the workspace: chosen once, when it is built ---------------------------------------------------------

class Probe(workspace.WorkspaceBase):
    pass


def _probe(monkeypatch, device=H200, world_size=2, hidden=7168, **kw):
    monkeypatch.setattr(gpu_facts, "describe_device", lambda index: device)
    ws = Probe.__new__(Probe)
    try:
        ws._init_common(world_size, 0, 4096, hidden, torch.bfloat16, 0, 10.0, None, 1, **kw)
    except Exception:  # noqa: BLE001 - past the selection, the geometry may need a GPU's limits
        pass
    return ws


def test_a_workspace_selects_when_it_is_built_and_never_per_call(monkeypatch, tmp_path):
    ws = _probe(monkeypatch)
    assert ws.selection.set == "h200_nvlink" and ws.oneshot_max_tokens == 292
    assert dispatch.select_program(ws, 292, None) == "moe_ar_oneshot_bf16_ws2_plain"
    assert dispatch.select_program(ws, 293, None) == "moe_ar_twoshot_pipelined_bf16_ws2_plain"

    def no_choice_per_call(*a, **k):
        raise AssertionError("a call chose a table set")
    for name in ("for_workspace", "resolve", "committed_for", "read_user_set"):
        monkeypatch.setattr(table_sets, name, no_choice_per_call)
    monkeypatch.setattr(gpu_facts, "describe_device", no_choice_per_call)
    for T in (1, 100, 292, 293, 4096):
        dispatch.select_program(ws, T, "nvfp4", True)
    # on another device the same arguments select with its tables: the model at world size 2
    monkeypatch.undo()
    other = _probe(monkeypatch, B200)
    assert other.selection.set == "model" and other.oneshot_max_tokens == 64
    assert dispatch.select_program(other, 65, None) == "moe_ar_twoshot_early_bf16_ws2_plain"


def test_a_workspace_takes_tables_and_boundaries_and_the_environment(monkeypatch, tmp_path):
    path = _user_file(tmp_path)
    ws = _probe(monkeypatch, tables=path)
    assert ws.selection.set == "tuned here" and ws.oneshot_max_tokens == 1024
    assert dispatch.select_program(ws, 1024, None) == "moe_ar_oneshot_bf16_ws2_plain"
    assert dispatch.select_program(ws, 1025, None) == "moe_ar_twoshot_pipelined_bf16_ws2_plain"
    monkeypatch.setenv(table_sets.ENV_VAR, str(path))
    assert _probe(monkeypatch).selection.set == "tuned here"
    pinned = _probe(monkeypatch, boundaries={"oneshot_max_tokens": 16})
    assert pinned.selection.pinned == {"oneshot_max_tokens": 16} and pinned.oneshot_max_tokens == 16
    assert dispatch.select_program(pinned, 17, None) != "moe_ar_oneshot_bf16_ws2_plain"
    # the argument comes before the environment
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_user_doc(name="the argument's")))
    assert _probe(monkeypatch, tables=other).selection.set == "the argument's"


def test_world_one_leaves_the_latency_program_where_its_grid_would_need_a_second_wave(monkeypatch):
    """The latency program runs a block a token on a grid of the blocks that fit at once: past that,
    a second wave (1.3x the time at H 7168, 136 tokens). Its range ends there, whatever the table."""
    from dispatch import op
    ws = _probe(monkeypatch, world_size=1)  # H 7168: the table keeps the latency program to 128 tokens
    waves = {}
    monkeypatch.setattr(op, "launcher_for", lambda ws, name: types.SimpleNamespace(
        one_wave_tokens=lambda: waves.setdefault(name, 100)))
    for quant in (None, "nvfp4", "fp8_group128", "fp8_tensor"):
        latency, streaming = (dispatch.select_program(ws, T, quant) for T in (100, 101))
        assert latency.startswith("moe_ar_local_bf16_ws1_") and streaming.startswith("moe_ar_local_streaming_bf16_ws1_")
        assert dispatch.select_program(ws, 1, quant, True) == latency
    assert set(waves) == {dispatch.select_program(ws, 1, q) for q in (None, "nvfp4", "fp8_group128", "fp8_tensor")}
    waves.clear()
    monkeypatch.setattr(op, "launcher_for", lambda ws, name: types.SimpleNamespace(one_wave_tokens=lambda: 132))
    assert [dispatch.select_program(ws, T) for T in (128, 129)] == ["moe_ar_local_bf16_ws1_plain",
                                                                    "moe_ar_local_streaming_bf16_ws1_plain"]

    def no_launcher(ws, name):
        raise AssertionError(f"{name}: loaded to choose a call the table gives the streaming program")
    monkeypatch.setattr(op, "launcher_for", no_launcher)
    assert dispatch.select_program(ws, 4096) == "moe_ar_local_streaming_bf16_ws1_plain"


def test_world_one_hands_calls_of_few_routes_to_the_streaming_program_past_256_tokens(monkeypatch):
    """At top_k 1-2 the streaming program's few-routes build is as fast as the latency program at 256
    tokens and faster above (bench_results/world_size_1/top_k_handover/): where that build serves the
    call, the latency program's range ends at FEW_ROUTES_LATENCY_MAX_TOKENS, whatever the table."""
    from dispatch import op, shape_constants
    assert shape_constants.FEW_ROUTES_LATENCY_MAX_TOKENS == 256
    ws = _probe(monkeypatch, world_size=1, hidden=2048)  # H 2048: the table keeps the latency program to 448-512
    asked = []

    def launcher(ws, name):
        asked.append(name)
        return types.SimpleNamespace(one_wave_tokens=lambda: 10**6,
                                     takes_few_routes=lambda top_k: "streaming" in name and top_k <= 2
                                     and "fp8_group128" not in name)
    monkeypatch.setattr(op, "launcher_for", launcher)
    for quant in (None, "nvfp4", "fp8_group128", "fp8_tensor"):
        table_end = ws.selection.limits(op.profile_for_quant(quant))["local_max_tokens"]
        assert table_end >= 384
        latency = dispatch.select_program(ws, table_end, quant)  # no top_k: the table alone
        assert latency.startswith("moe_ar_local_bf16_ws1_")
        streaming = latency.replace("moe_ar_local_", "moe_ar_local_streaming_")
        for top_k in (1, 2):
            assert dispatch.select_program(ws, 256, quant, top_k=top_k) == latency
            assert dispatch.select_program(ws, 257, quant, True, top_k=top_k) == (
                latency if quant == "fp8_group128" else streaming)
        assert dispatch.select_program(ws, table_end, quant, top_k=3) == latency
        assert dispatch.select_program(ws, table_end + 1, quant, top_k=2) == streaming  # the table's own end
    for bad in (0, 17, 2.0, True, "2"):
        with pytest.raises(ValueError, match="^top_k: "):
            dispatch.select_program(ws, 300, None, top_k=bad)
    # the streaming program's launcher is asked only where the latency program would run past 256 tokens
    asked.clear()
    dispatch.select_program(ws, 100, None, top_k=2)
    dispatch.select_program(ws, 4096, None, top_k=2)
    assert all("streaming" not in name for name in asked), asked


def test_the_choice_is_logged_once(monkeypatch, caplog):
    table_sets._said.clear()
    with caplog.at_level(logging.INFO, logger="moe_ar.tables"):
        _probe(monkeypatch)
        _probe(monkeypatch)
        _probe(monkeypatch, B200)
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_ar.tables"]
    assert len(lines) == 2, lines
    assert lines[0] == ("moe_ar tables: NVIDIA H200 (compute capability 9.0, 132 SMs, interconnect nvlink): set "
                        "h200_nvlink (exact product) for bf16 world size 2")
    assert lines[1].startswith("moe_ar tables: NVIDIA B200 ") and "set model (no committed set matches)" in lines[1]


def test_selection_info_says_the_set_and_each_cells_source(monkeypatch, tmp_path):
    ws = _probe(monkeypatch, tables=_user_file(tmp_path))
    info = dispatch.selection_info(ws)
    assert info["set"] == "tuned here" and info["user_set"] == str(tmp_path / "tables.json")
    assert info["device"] == {"product": "NVIDIA H200", "capability": "9.0", "sm_count": 132, "interconnect": "nvlink"}
    assert info["cells"]["plain"] == {"boundaries": dict(zip(FIELDS, from_oneshot(1024))), "set": "tuned here",
                                      "source": "measured here; T outside 1..2048 from h200_nvlink"}
    assert info["cells"]["nvfp4"]["set"] == "h200_nvlink" and info["cells"]["nvfp4"]["source"].startswith("measured in ")
    assert dispatch.selection_info(types.SimpleNamespace(workspaces=[ws])) == info  # an EmulatedWorld: rank 0's
    with pytest.raises(ValueError, match="^workspace: expected a Workspace"):
        dispatch.selection_info(object())


def test_ranks_that_select_differently_are_refused_naming_tables():
    descriptors = [rendezvous.RankDescriptor(
        world_size=2, program_set="a" * 64, dtype="torch.bfloat16", hidden=7168, max_tokens=512,
        oneshot_max_tokens=256, vec_per_thread=None, timeout_ns=10, buffer_bytes=1, host="h", gpu=f"GPU-{r}",
        selection=label) for r, label in enumerate(("h200_nvlink 0123456789ab", "model ba9876543210"))]
    with pytest.raises(ValueError, match=r"^tables: rank 1 has selection tables model ba9876543210 .*rank 0 has "
                                         r"selection tables h200_nvlink 0123456789ab"):
        rendezvous.compare_descriptors(descriptors)


def test_the_runtime_reads_what_the_generator_writes():
    """The runtime (which never imports the generator) reads the table-set file's name and version
    and the keys from the manifest, which the generator writes from its own."""
    from generator import fit
    from generator import table_sets as generator_sets
    assert table_sets.tune_format() == (generator_sets.TUNE_FORMAT, generator_sets.TUNE_VERSION)
    assert table_sets.keys() == frozenset(fit.KEYS)
