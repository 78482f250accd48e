"""The runtime's selection and manifest handling, without a GPU."""
import pytest
import torch

from dispatch import gpu_facts, registry, table_sets


def test_the_ladder_and_all_tokens_are_the_generators():
    """The runtime reads the regime ladder and the "no bound" value from the manifest; both are the
    generator's, written once there."""
    from generator import spec, tuning
    generated = registry.program_set()
    assert generated.all_tokens == tuning.ALL_TOKENS
    assert generated.ladder == [(regime.name, regime.max_tokens_field) for regime in spec.LADDER]
    assert not hasattr(registry, "ALL_TOKENS")


H200 = gpu_facts.DeviceKey("NVIDIA H200", "9.0", 132, "nvlink")


def _bounds(dtype, ws, profile, hidden=7168):
    """{field: tokens} of a cell as a workspace of `hidden` on an H200 with NVLink selects it."""
    selection = table_sets.resolve(dtype=dtype, world_size=ws, hidden=hidden, elem_bytes=2, device=H200, user=None,
                                   program_set_sha256="")
    return selection.limits(profile)


def _cells():
    _, model = table_sets.committed_sets()
    return sorted(model.cells)


BIG = 10 ** 6  # a one-shot buffer larger than any boundary


def _old_select_family(bounds, dtype, ws, profile, tokens, has_shared, oneshot_capacity):
    """The selection rule as the runtime wrote it out before the manifest carried the ladder."""
    if tokens <= min(bounds["oneshot_max_tokens"], oneshot_capacity):
        regime = "oneshot"
    elif tokens <= bounds["early_max_tokens"]:
        regime = "twoshot_early"
    elif tokens <= bounds["twoshot_max_tokens"]:
        regime = "twoshot"
    elif tokens <= bounds["loads_max_tokens"]:
        regime = "twoshot_pipelined_loads"
    else:
        regime = "twoshot_pipelined"
    shared = {"twoshot": "twoshot_shared", "twoshot_early": "twoshot_early_shared"}.get(regime)
    if has_shared and shared is not None and (shared, dtype, ws, profile) in registry.program_set().cells:
        return shared
    return regime


def _exchange_fields():
    """The boundary fields of the exchange rungs: the ladder less world size 1's local rung, whose
    boundary is 0 at every other world size (it serves no T there)."""
    return [field for regime, field in registry.program_set().ladder if field is not None
            and not regime.startswith("local")]


def _dense_tokens(bounds, every_up_to=2100):
    """Every T up to every_up_to (by default past every measured boundary), both sides of every
    boundary, powers of two (and three times them) up to the largest T a boundary can take."""
    tokens = set(range(1, every_up_to + 1))
    for bound in bounds:
        tokens |= {t for t in (bound - 2, bound - 1, bound, bound + 1, bound + 2) if t >= 1}
    tokens |= {2 ** k for k in range(31)} | {3 * 2 ** k for k in range(29)}
    return sorted(t for t in tokens if t <= registry.program_set().all_tokens)


def _capacities(bounds):
    """One-shot buffers (tokens) smaller than, equal to and larger than the one-shot boundary."""
    oneshot = bounds[0]
    return sorted({1, max(oneshot - 1, 0), oneshot, oneshot + 1, BIG})


def test_select_family_is_the_old_rule_for_every_cell():
    """The ladder loop chooses what the old written-out rule chose: every cell of the committed
    table (as an H200 workspace of hidden 7168 selects it) at world sizes 2 and up (the local rung
    first on the ladder changes none of them), a dense set of T, with and without a shared operand,
    one-shot buffers smaller, equal and larger than the one-shot boundary; at world size 1, local up to
    local_max_tokens, local_streaming above."""
    fields = _exchange_fields()
    checked = 0
    for (dtype, ws, profile) in _cells():
        row = _bounds(dtype, ws, profile)
        bounds = [row[field] for field in fields]
        if ws == 1:
            for capacity in _capacities(bounds):
                for tokens in _dense_tokens(bounds):
                    for has_shared in (False, True):
                        want = "local" if tokens <= row["local_max_tokens"] else "local_streaming"
                        assert registry.select_family(dtype, ws, profile, tokens, has_shared, capacity,
                                                      bounds=row) == want
            continue
        assert row["local_max_tokens"] == 0, (dtype, ws, profile)
        for capacity in _capacities(bounds):
            for tokens in _dense_tokens(bounds):
                for has_shared in (False, True):
                    got = registry.select_family(dtype, ws, profile, tokens, has_shared, capacity, bounds=row)
                    assert got == _old_select_family(row, dtype, ws, profile, tokens, has_shared, capacity), (
                        dtype, ws, profile, tokens, has_shared, capacity)
                    checked += 1
    assert checked > 400_000


def test_select_family_at_zero_tokens_is_the_choice_at_one():
    """A call of 0 tokens launches nothing, but select_program still names a program: the one 1 token
    runs (the local rungs' boundary of 0 at world sizes 2 and up must not select a hole there)."""
    for (dtype, ws, profile) in _cells():
        row = _bounds(dtype, ws, profile)
        for has_shared in (False, True):
            for capacity in (0, 1, BIG):
                at_zero = registry.select_family(dtype, ws, profile, 0, has_shared, capacity, bounds=row)
                assert at_zero == registry.select_family(dtype, ws, profile, 1, has_shared, capacity, bounds=row)
                registry.program_for(at_zero, dtype, ws, profile)


NO_BOUND = 2 ** 31 - 1


@pytest.mark.parametrize("bounds", [(0, 0, 0, 0), (1, 2, 3, 4), (64, 512, 2048, 8192), (16, 16, NO_BOUND, NO_BOUND),
                                    (100, 200, 200, NO_BOUND), (0, 300, 300, 300), (7, 7, 7, 900)])
def test_select_family_is_the_old_rule_for_other_boundaries(bounds):
    """The same with exchange boundaries that give every regime a range somewhere (the committed
    table leaves some empty); world size 1 still selects local every time."""
    fields = _exchange_fields()
    for (dtype, ws, profile) in _cells():
        local = {field: (NO_BOUND if ws == 1 else 0) for regime, field in registry.program_set().ladder
                 if field is not None and field not in fields}  # world size 1: the latency layout for every T
        row = {**local, **dict(zip(fields, bounds))}
        for capacity in _capacities(bounds):
            for tokens in _dense_tokens(bounds, every_up_to=600):
                for has_shared in (False, True):
                    got = registry.select_family(dtype, ws, profile, tokens, has_shared, capacity, bounds=row)
                    want = "local" if ws == 1 else _old_select_family(row, dtype, ws, profile, tokens, has_shared,
                                                                      capacity)
                    assert got == want, (dtype, ws, profile, tokens, has_shared, capacity, bounds)


@pytest.mark.parametrize("ws", [2, 4, 8])
@pytest.mark.parametrize("profile", ["plain", "nvfp4", "fp8_group128"])
def test_select_family_follows_the_committed_boundaries(ws, profile):
    b = _bounds("bf16", ws, profile)
    fields = ("oneshot_max_tokens", "early_max_tokens", "twoshot_max_tokens", "loads_max_tokens")
    bounds = [b[f] for f in fields]
    regimes = ("oneshot", "twoshot_early", "twoshot", "twoshot_pipelined_loads", "twoshot_pipelined")

    def expected(T):  # the first regime whose upper bound T does not exceed, written out independently
        return next((r for r, upper in zip(regimes, bounds) if T <= upper), regimes[-1])

    oneshot = bounds[0]
    assert registry.select_family("bf16", ws, profile, oneshot, False, BIG, bounds=b) == "oneshot"
    for edge in bounds:
        for T in (edge, edge + 1):
            if 1 <= T < registry.program_set().all_tokens:
                assert registry.select_family("bf16", ws, profile, T, False, BIG, bounds=b) == expected(T), (T, bounds)
    # the register-load pipelined program, where a hole, falls back to the ring one, then the two-shot
    assert registry.program_for("twoshot_pipelined_loads", "bf16", 2, "plain") == "moe_ar_twoshot_pipelined_bf16_ws2_plain"
    assert registry.program_for("twoshot_pipelined_loads", "bf16", 4, "nvfp4") == "moe_ar_twoshot_bf16_ws4_nvfp4"
    # where the pipelined two-shot is a hole, the two-shot runs (named explicitly)
    assert registry.program_for("twoshot_pipelined", "bf16", 4, profile) == f"moe_ar_twoshot_bf16_ws4_{profile}"
    # a workspace whose one-shot buffer is smaller than the boundary caps the one-shot range
    if oneshot > 1:
        assert registry.select_family("bf16", ws, profile, oneshot, False, oneshot - 1, bounds=b) != "oneshot"


def test_shared_variant_only_where_generated_and_holes_fall_back():
    # world size 2 has no shared variants (holes): the base family runs, named explicitly.
    b2 = _bounds("bf16", 2, "plain")
    e2 = b2["early_max_tokens"]
    assert registry.select_family("bf16", 2, "plain", e2 + 1, True, BIG, bounds=b2) == (
        "twoshot" if b2["twoshot_max_tokens"] > e2 else "twoshot_pipelined")
    b4 = _bounds("bf16", 4, "plain")
    e4 = b4["early_max_tokens"]
    assert registry.select_family("bf16", 4, "plain", e4 + 1, True, BIG, bounds=b4) == "twoshot_shared"
    assert registry.program_for("twoshot_shared", "bf16", 2, "plain") == "moe_ar_twoshot_bf16_ws2_plain"
    assert registry.program_for("twoshot_early_shared", "fp16", 8, "nvfp4") == "moe_ar_twoshot_early_fp16_ws8_nvfp4"
    with pytest.raises(ValueError, match="^program: no program for bf16 world size 2 output profile o110"):
        registry.program_for("twoshot", "bf16", 2, "o110")  # an old name code is no profile


def test_profiles_are_named_by_their_quant_value():
    from dispatch.op import profile_for_quant
    assert registry.program_set().profile_of_quant == {None: "plain", "nvfp4": "nvfp4",
                                                       "fp8_group128": "fp8_group128", "fp8_tensor": "fp8_tensor"}
    assert profile_for_quant(None) == "plain" and profile_for_quant("nvfp4") == "nvfp4"
    assert registry.program_info("moe_ar_twoshot_shared_bf16_ws4_nvfp4")["profile"] == "nvfp4"


@pytest.mark.parametrize("hidden", [1024, 4096, 7168, 8192, 16384])
def test_row_split_follows_tokens(hidden):
    """Default geometry: 2 vectors a thread up to few_tokens_max tokens where the row fits in
    max_threads, 4 above; every vector of the row has a thread, every block is whole warps."""
    from dispatch.workspace import WorkspaceBase
    from dispatch.workspace_sizes import ALL_TOKENS
    limits = registry.program_set().limits
    ws = WorkspaceBase()
    ws._init_common(2, 0, 4096, hidden, torch.bfloat16, 0, 1.0, None, ranks_on_device=1)
    nvec = hidden // 8
    for s in ws.row_splits:
        assert s.threads % 32 == 0 and s.threads <= limits["max_threads"]
        assert s.threads * s.vec_per_thread >= nvec > s.threads * (s.vec_per_thread - 1)
    assert ws.row_splits[-1].max_tokens == ALL_TOKENS
    assert ws.row_splits[-1].vec_per_thread == -(-nvec // ws.row_splits[-1].threads)
    few = limits["few_tokens_max"]
    two_splits = 32 * -(-nvec // (32 * limits["few_tokens_vec_per_thread"])) <= limits["max_threads"]
    assert len(ws.row_splits) == (2 if two_splits else 1)
    for T, expect_few in ((1, True), (few, True), (few + 1, False), (4096, False)):
        chosen = ws.row_splits[ws.row_split_index(T)]
        assert chosen.threads == (ws.row_splits[0].threads if expect_few else ws.row_splits[-1].threads)
    # a fixed split is one split for every call
    fixed = WorkspaceBase()
    fixed._init_common(2, 0, 4096, hidden, torch.bfloat16, 0, 1.0, None, ranks_on_device=1, vec_per_thread=4)
    assert len(fixed.row_splits) == 1 and fixed.row_split_index(1) == fixed.row_split_index(4096) == 0


def test_balanced_grid_gives_every_block_the_same_columns_give_or_take_one():
    from dispatch.launcher import balanced_grid
    assert balanced_grid(1024, 396) == 342  # 3 columns each (the last two blocks 2), not 232 x 3 + 164 x 2
    assert balanced_grid(792, 396) == 396   # already even: every block 2 columns
    assert balanced_grid(10, 396) == 10     # fewer columns than blocks: one each
    assert balanced_grid(1, 1) == 1
    for units in range(1, 3000, 7):
        for max_blocks in (1, 5, 132, 396, 528):
            grid = balanced_grid(units, max_blocks)
            assert 1 <= grid <= min(units, max_blocks)
            rounds = -(-units // min(units, max_blocks))  # the rounds of the largest grid
            assert -(-units // grid) == rounds            # no round more
            last_round = units - (rounds - 1) * grid       # blocks that take a column in the last round
            assert grid - rounds < last_round <= grid      # all but fewer than `rounds` of them


def test_dynamic_smem_is_the_row_ring_where_a_program_has_one():
    """The launcher's dynamic shared memory (manifest launch.dynamic_smem): a program with the row
    ring (the pipelined two-shot's) gets its rows of H elements and
    128 bytes of barriers; every other program none. The largest must fit one block of sm_90 and
    sm_100 (227 KiB)."""
    ringed = set()
    for name in registry.programs():
        info = registry.program_info(name)
        stages = info["row_stages"]
        nbytes = registry.dynamic_smem_bytes(info, 7168, 2)
        if stages:
            ringed.add(info["family"])
            assert nbytes == stages * 7168 * 2 + 128
            max_hidden = registry.program_set().limits["max_hidden"]
            assert registry.dynamic_smem_bytes(info, max_hidden, 2) <= 227 * 1024
        else:
            assert nbytes == 0
    assert ringed == {"twoshot_pipelined"}
