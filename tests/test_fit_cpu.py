"""The fit (generator/fit.py) on synthetic measurements with noise: boundaries that follow the
measurements, never decrease, move off the prior only for a win beyond the noise, keep one crossover
where the argmin flickers; and a partial measurement that the runtime never stretches past its range."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generator import fit, spec, tuning

ALL = tuning.ALL_TOKENS
PRIOR = tuning.model(2).limits  # oneshot to 64, early to 512, then the two-shot
ONESHOT = spec.BOUNDARY_FIELDS.index("oneshot_max_tokens")


def lim(*from_oneshot):
    """Boundaries from the one-shot's on; a rung before it (none measured here) ends at 0."""
    return (0,) * ONESHOT + from_oneshot


def _times(noise=0.0, shape=(7168, 8, True), **families):
    """Synthetic measurements at one shape: family -> {T: us}, each with a relative `noise`."""
    points = {}
    for family, by_t in families.items():
        for T, us in by_t.items():
            points.setdefault((*shape, T), {})[family] = fit.Time(us, us * noise)
    return points


def _fit(points, prior=PRIOR, **kw):
    return fit.fit_cell(points, prior, key=kw.pop("key", "tokens"), **kw)


def test_fit_follows_the_measurements():
    # one-shot fastest to 64, early fastest at 128..256, two-shot from 512
    points = _times(oneshot={1: 5, 64: 10, 128: 30, 256: 60},
                    twoshot_early={1: 9, 64: 12, 128: 20, 256: 40, 512: 90, 1024: 200},
                    twoshot={1: 12, 64: 15, 128: 25, 256: 45, 512: 80, 1024: 150})
    result = _fit(points)
    # the pipelined two-shots were not measured: never chosen, not even above the measured range
    assert result.limits == lim(64, 256, ALL, ALL) and result.measured == (1, 1024)
    assert (result.worst, result.mean, result.over, result.over_at_target) == (1.0, pytest.approx(1.0), 0, 0)
    assert result.points == 6 and result.describe().startswith("0 of 6 points over 1.05x the best program")
    # never picks the one-shot where it was not measured (a workspace cap); the last rung chosen
    # takes "all" (beyond the measured range the runtime serves the next set's choice)
    points = _times(oneshot={1: 1}, twoshot_early={1: 9, 2: 9}, twoshot={1: 12, 2: 12})
    assert _fit(points).limits == lim(1, ALL, ALL, ALL) and _fit(points).measured == (1, 2)
    # pipelined fastest from 1024: it takes over there; the two-shot keeps 512
    points = _times(oneshot={1: 5, 64: 10, 128: 30, 256: 60},
                    twoshot_early={1: 9, 64: 12, 128: 20, 256: 40, 512: 90, 1024: 200, 2048: 400},
                    twoshot={1: 12, 64: 15, 128: 25, 256: 45, 512: 80, 1024: 150, 2048: 300},
                    twoshot_pipelined={1: 30, 64: 30, 128: 40, 256: 60, 512: 85, 1024: 140, 2048: 270})
    assert _fit(points).limits == lim(64, 256, 512, 512)
    # the pipelined two-shot with register loads fastest at 1024 only: it takes that range, the
    # ring the rest; a tie with the ring leaves it out (loads_max_tokens == twoshot_max_tokens)
    for T, us in {256: 70, 512: 86, 1024: 130, 2048: 280}.items():
        points[(7168, 8, True, T)]["twoshot_pipelined_loads"] = fit.Time(us, 0.0)
    assert _fit(points).limits == lim(64, 256, 512, 1024)
    points[(7168, 8, True, 1024)]["twoshot_pipelined_loads"] = fit.Time(140, 0.0)
    assert _fit(points).limits == lim(64, 256, 512, 512)
    for times in points.values():
        times.pop("twoshot_pipelined_loads", None)
    # without the two-shot measured, the pipelined one follows the early one directly
    # (twoshot_max_tokens == early_max_tokens: no T runs the two-shot)
    for times in points.values():
        del times["twoshot"]
    assert _fit(points).limits == lim(64, 256, 256, 256)


def test_fit_counts_points_over_the_target_first():
    """The target is per point (within 5% of the best program): a rule with fewer points over it
    wins even where its mean slowdown is larger."""
    points = {(4096, 8, False, 1): {"oneshot": fit.Time(100, 0), "twoshot_early": fit.Time(115, 0)},
              (7168, 8, True, 1): {"oneshot": fit.Time(106, 0), "twoshot_early": fit.Time(100, 0)},
              (7168, 4, True, 1): {"oneshot": fit.Time(106, 0), "twoshot_early": fit.Time(100, 0)}}
    result = _fit(points)
    assert result.limits == lim(0, ALL, ALL, ALL)  # the early two-shot: one point over, not two
    assert result.over == 1 and result.over_at_target == 0 and result.worst == pytest.approx(1.15)
    assert result.mean == pytest.approx(1.15 ** (1 / 3))


def test_fit_counts_the_target_shape_before_the_others():
    """A point over the target at the issue's shape (TARGET_SHAPE) outweighs any number elsewhere."""
    assert fit.TARGET_SHAPE == (7168, 8, True)
    at_target = {"oneshot": fit.Time(100, 0), "twoshot_early": fit.Time(106, 0)}
    elsewhere = {"oneshot": fit.Time(110, 0), "twoshot_early": fit.Time(100, 0)}
    points = {(7168, 8, True, 1): at_target, (7168, 8, False, 1): elsewhere, (4096, 8, False, 1): elsewhere}
    result = _fit(points)
    assert result.limits == lim(ALL, ALL, ALL, ALL)  # the one-shot: two over, none at the target shape
    assert result.over == 2 and result.over_at_target == 0 and result.worst == pytest.approx(1.1)
    # the same points with the shapes swapped: the early two-shot, one point over, at another shape
    points = {(4096, 8, False, 1): at_target, (7168, 8, True, 1): elsewhere, (7168, 4, True, 1): elsewhere}
    assert _fit(points).limits == lim(0, ALL, ALL, ALL)


def test_a_point_over_the_target_within_its_noise_is_not_counted_as_one():
    """6% slower than the best with 3% noise on each is not clearly over the 5% target: the prior stays."""
    points = _times(noise=0.03, oneshot={64: 106, 128: 300}, twoshot_early={64: 100, 128: 150})
    assert _fit(points).limits == lim(64, ALL, ALL, ALL)  # the prior's one-shot keeps T = 64
    assert _fit(points).over == 1  # ... and the report counts the point as today: over 1.05x
    points = _times(noise=0.0, oneshot={64: 106, 128: 300}, twoshot_early={64: 100, 128: 150})
    assert _fit(points).limits == lim(0, ALL, ALL, ALL)


@pytest.mark.parametrize("win,noise,moves", [(0.02, 0.01, False), (0.04, 0.01, True), (0.04, 0.02, False),
                                             (0.005, 0.0, False), (0.015, 0.0, True)])
def test_a_boundary_moves_off_the_prior_only_when_the_win_beats_the_noise_by_the_margin(win, noise, moves):
    """The prior (the written model) runs the one-shot to 64; the early two-shot measures `win`
    faster at 64. The boundary moves to 32 only when the win beats both programs' noise plus MIN_WIN."""
    assert fit.MIN_WIN == 0.01
    oneshot, early = {32: 10, 64: 10, 128: 30}, {32: 12, 64: 10 * math.exp(-win), 128: 15}
    assert _fit(_times(noise=noise, oneshot=oneshot, twoshot_early=early)).limits[ONESHOT] == (32 if moves else 64)
    # with no margin and no noise, any win moves it
    assert _fit(_times(oneshot=oneshot, twoshot_early=early), margin=0.0).limits[ONESHOT] == 32


def test_a_flickering_argmin_gives_one_crossover_at_the_prior():
    """Around the crossover the faster of two programs alternates from one T to the next by less
    than the noise: one boundary, where the prior has it, not one per flip."""
    rnd = random.Random(7)
    oneshot, early = {}, {}
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        base = 10 + T / 16
        # clearly one-shot below 16, clearly early above 128, a coin flip of +-0.5% in between
        shift = 0.3 if T < 16 else -0.3 if T > 128 else rnd.choice((-0.005, 0.005))
        oneshot[T], early[T] = base, base * math.exp(shift)
    flips = [T for T in oneshot if 16 <= T <= 128]
    assert {oneshot[T] < early[T] for T in flips} == {True, False}  # the argmin does flicker
    points = _times(noise=0.01, oneshot=oneshot, twoshot_early={**early, 2048: 500}, twoshot={2048: 400})
    result = _fit(points)
    assert result.limits[ONESHOT] == PRIOR[ONESHOT] == 64
    assert result.limits[ONESHOT + 1:] == (1024, ALL, ALL)  # the early two-shot to 1024, then the two-shot (measured at 2048)
    # with no noise and no margin it chases the flips, yet still with one crossover (the ladder)
    chased = _fit(_times(oneshot=oneshot, twoshot_early={**early, 2048: 500}, twoshot={2048: 400}), margin=0.0)
    assert chased.limits[ONESHOT] in flips and list(chased.limits) == sorted(chased.limits)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(*[st.floats(1.0, 100.0)] * len(tuning.LADDER_FAMILIES)), min_size=1, max_size=9),
       st.floats(0.0, 0.05), st.sampled_from(fit.KEYS))
def test_boundaries_never_decrease_and_each_rung_is_one_range(rows, noise, key):
    """Whatever the times: the boundaries follow the ladder, and each measured point's rung is
    the rung its key value falls in (so each regime serves one contiguous range)."""
    points = {}
    for i, times in enumerate(rows):
        T = 2 ** i
        for hidden in (4096, 7168):
            points[(hidden, 8, False, T)] = {family: fit.Time(us * hidden / 4096, us * noise)
                                             for family, us in zip(tuning.LADDER_FAMILIES, times)}
    result = fit.fit_cell(points, PRIOR, key=key)
    assert list(result.limits) == sorted(result.limits) and result.limits[0] >= 0
    rungs = [fit.rung_of(result.limits, fit.key_value(key, T, H, 2)) for H, _, _, T in sorted(
        points, key=lambda p: fit.key_value(key, p[3], p[0], 2))]
    assert rungs == sorted(rungs)
    assert result.measured == (fit.key_value(key, 1, 4096, 2), fit.key_value(key, 2 ** (len(rows) - 1), 7168, 2))


def test_the_bytes_key_follows_a_crossover_at_the_same_bytes_per_rank():
    """Two hidden sizes whose one-shot / two-shot crossover lies at the same bytes per rank (4 MiB):
    the bytes key fits both exactly, the token key cannot."""
    points = {}
    for hidden in (4096, 7168):
        for T in (64, 128, 256, 512, 1024):
            rows = T * hidden * 2
            points[(hidden, 8, False, T)] = {"oneshot": fit.Time(10 if rows <= 4 << 20 else 20, 0),
                                             "twoshot_early": fit.Time(15, 0)}
    by_bytes = fit.fit_cell(points, PRIOR, key="bytes_per_rank")
    assert by_bytes.limits[ONESHOT] == 512 * 4096 * 2 and by_bytes.over == 0 and by_bytes.worst == 1.0
    by_tokens = fit.fit_cell(points, PRIOR, key="tokens")
    assert by_tokens.over == 1 and by_tokens.worst == pytest.approx(20 / 15)  # one of the two shapes loses at 512


WORLD_ONE = tuning.model(1).limits  # local to 256 tokens, then the streaming layout
STREAMING = spec.BOUNDARY_FIELDS.index("local_max_tokens")


def _world_one(hidden_wins):
    """World size 1 at two hidden sizes: {hidden: T from which the streaming layout is faster} (None:
    never); 10% either way."""
    points = {}
    for hidden, from_t in hidden_wins.items():
        for T in (1, 16, 128, 256, 512, 1024, 4096):
            streaming_wins = from_t is not None and T >= from_t
            points[(hidden, 8, hidden == 7168, T)] = {"local": fit.Time(11.0 if streaming_wins else 10.0, 0.0),
                                                      "local_streaming": fit.Time(10.0 if streaming_wins else 11.0, 0.0)}
    return points


def test_a_hidden_size_the_joint_boundary_misserves_gets_its_own():
    """The crossover of world size 1 lies at 256 tokens at H 7168 and nowhere at H 4096 (the latency
    layout's occupancy differs with the row's threads): no one byte boundary serves both. The joint
    fit keeps the target shape exact; H 4096 gets boundaries of its own, and the counts are those of
    the choice with them."""
    points = _world_one({7168: 256, 4096: None})
    joint = fit.fit_cell(points, WORLD_ONE, key="bytes_per_rank")
    assert joint.over == 3 and joint.over_at_target == 0  # H 4096 at 512, 1024 and 4096 on streaming
    result = fit.fit_cell_by_hidden(points, WORLD_ONE, key="bytes_per_rank")
    assert result.limits == joint.limits and 128 * 7168 * 2 <= result.limits[STREAMING] < 256 * 7168 * 2
    assert result.by_hidden == ((4096, (ALL,) * len(spec.BOUNDARY_FIELDS), (4096 * 2, 4096 * 4096 * 2)),)
    assert (result.over, result.worst, result.points) == (0, 1.0, 14)
    assert result.describe().endswith("; own boundaries at hidden 4096")
    # the runtime's view: each hidden size served by its own row, every other by the joint one
    bounds = tuning.Boundaries(result.limits, "test", result.key, result.measured, result.by_hidden)
    assert bounds.measured_at(4096) == (4096 * 2, 4096 * 4096 * 2) and bounds.measured_at(7168) == result.measured
    assert bounds.family(4096 * 4096 * 2, 4096) == "local"
    assert bounds.family(4096 * 4096 * 2, 7168) == bounds.family(4096 * 4096 * 2, 5120) == "local_streaming"


def test_hidden_sizes_the_joint_boundary_serves_get_none_of_their_own():
    """The same crossover in bytes at both sizes (or one hidden size only): no row of its own, the fit is fit_cell's."""
    same_bytes = _world_one({7168: 256, 4096: 512})  # 3.5 and 4 MiB: between the same measured points
    assert fit.fit_cell_by_hidden(same_bytes, WORLD_ONE, key="bytes_per_rank") == \
        fit.fit_cell(same_bytes, WORLD_ONE, key="bytes_per_rank")
    one = _world_one({7168: 256})
    assert fit.fit_cell_by_hidden(one, WORLD_ONE, key="bytes_per_rank").by_hidden == ()


def test_a_hidden_size_keeps_the_joint_boundary_unless_its_own_wins_beyond_the_margin():
    """H 4096 loses 0.5% on the streaming layout (less than fit.MIN_WIN): no row of its own."""
    points = _world_one({7168: 256, 4096: 10 ** 6})
    for point, times in points.items():
        if point[0] == 4096:
            times["local_streaming"] = fit.Time(times["local"].median_us * 1.005, 0.0)
    assert fit.fit_cell_by_hidden(points, WORLD_ONE, key="bytes_per_rank").by_hidden == ()


def test_boundaries_of_a_hidden_size_are_checked_as_the_cells():
    with pytest.raises(ValueError, match="^limits"):
        tuning.Boundaries(WORLD_ONE, "test", by_hidden=((4096, (5, 4) + WORLD_ONE[2:], (1, 2)),))
    with pytest.raises(ValueError, match="^by_hidden"):
        tuning.Boundaries(WORLD_ONE, "test", by_hidden=((7168, WORLD_ONE, (1, 2)), (4096, WORLD_ONE, (1, 2))))
    with pytest.raises(ValueError, match="^by_hidden"):
        tuning.Boundaries(WORLD_ONE, "test", by_hidden=((0, WORLD_ONE, (1, 2)),))


def test_a_partial_measurement_records_its_range_and_the_runtime_never_stretches_it():
    """The one-shot fastest at every T measured (to 512): the fit's limits say "to the end", but its
    range ends at 512, and the runtime serves larger T as the next set (the written model) does,
    never as the nearest measured key."""
    from dispatch.table_sets import compose
    points = _times(oneshot={T: 5 + T / 64 for T in (1, 8, 64, 512)}, twoshot_early={T: 9 + T / 64 for T in (1, 8, 64, 512)})
    result = _fit(points)
    assert result.limits == lim(ALL, ALL, ALL, ALL) and result.measured == (1, 512)
    served = compose(result.limits, result.measured, PRIOR, ALL)
    assert served == lim(512, 512, ALL, ALL)  # one-shot to 512, then the model's next rung (two-shot), not one-shot
    assert fit.rung_of(served, 4096) == fit.rung_of(PRIOR, 4096)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="^median_us"):
        fit.Time(0.0, 0.0)
    with pytest.raises(ValueError, match="^noise_us"):
        fit.Time(1.0, -1.0)
    with pytest.raises(ValueError, match="^points: nothing measured"):
        fit.fit_cell({}, PRIOR)
    with pytest.raises(ValueError, match="^prior"):
        fit.fit_cell(_times(oneshot={1: 1}), PRIOR[:-1])
    with pytest.raises(ValueError, match="^key"):
        fit.key_value("rows", 1, 1, 2)
    with pytest.raises(ValueError, match="^points: no family"):
        fit.fit_cell({(7168, 8, True, 1): {"oneshot": fit.Time(1, 0)},
                      (4096, 8, True, 1): {"twoshot": fit.Time(1, 0)}}, PRIOR, key="tokens")


def _world_one_window(lo, hi):
    """World size 1 at H 4096 and 7168: the streaming layout 10% faster for lo <= T <= hi at H 4096 (the
    latency layout faster below and above: bench_results/world_size_1/small_hidden/), from 256 tokens
    at H 7168."""
    points = _world_one({7168: 256})
    for T in (1, 16, 128, 256, 512, 1024, 4096):
        streaming_wins = lo <= T <= hi
        points[(4096, 8, False, T)] = {"local": fit.Time(11.0 if streaming_wins else 10.0, 0.0),
                                       "local_streaming": fit.Time(10.0 if streaming_wins else 11.0, 0.0)}
    return points


def test_at_world_size_one_every_exchange_rung_runs_the_latency_layout():
    """The exchange families are holes at world size 1 that fall back to `local` (generator/enumeration.py):
    a rung after the streaming one runs the latency layout again."""
    families = tuning.ladder_families(1)
    assert families[:2] == ("local", "local_streaming") and set(families[2:]) == {"local"}
    assert tuning.ladder_families(2) == tuning.LADDER_FAMILIES and tuning.ladder_families(8) == tuning.LADDER_FAMILIES


def test_a_world_size_one_ladder_returns_to_the_latency_layout_where_it_wins_again():
    """H 4096: the latency layout to 128 tokens, the streaming one at 256-1,024, the latency one again
    from 4,096. With the rungs' fallback families the fit serves every point by the faster program;
    without them (the exchange rungs unmeasured) one crossover is the best it can do."""
    points = {p: t for p, t in _world_one_window(256, 1024).items() if p[0] == 4096}
    one_crossover = fit.fit_cell(points, WORLD_ONE, key="bytes_per_rank")
    assert one_crossover.over >= 1
    result = fit.fit_cell(points, WORLD_ONE, key="bytes_per_rank", families=tuning.ladder_families(1))
    assert (result.over, result.worst) == (0, 1.0)
    row = 4096 * 2
    assert result.limits[0] == 128 * row and result.limits[1] == 1024 * row
    bounds = tuning.Boundaries(result.limits, "test", result.key, result.measured)
    served = [tuning.ladder_families(1)[fit.rung_of(result.limits, T * row)] for T in (1, 128, 256, 1024, 4096)]
    assert served == ["local", "local", "local_streaming", "local_streaming", "local"]
    assert bounds.family(4096 * row, 4096) == "oneshot"  # the rung; the hole runs `local` (dispatch.registry)


def test_the_joint_world_size_one_ladder_keeps_the_target_shape_and_h4096_gets_its_return():
    """Both hidden sizes: the joint boundaries (every unmeasured hidden size's) keep one crossover, the
    streaming layout above 256 tokens as at H 7168, even where a return would suit the points jointly;
    H 4096 gets its own, which return to the latency layout."""
    points = _world_one_window(256, 1024)
    result = fit.fit_cell_by_hidden(points, WORLD_ONE, key="bytes_per_rank", own_families=tuning.ladder_families(1))
    assert result.limits[1] == ALL and 128 * 7168 * 2 <= result.limits[0] < 256 * 7168 * 2
    (hidden, own, _measured), = result.by_hidden
    assert hidden == 4096 and own[:2] == (128 * 4096 * 2, 1024 * 4096 * 2) and own[2] == ALL
    assert (result.over, result.worst) == (0, 1.0)


def test_the_joint_world_size_one_ladder_never_returns_even_where_the_points_would_prefer_it():
    """The latency layout 0.5% faster at H 7168's 4,096 tokens (within the margin) and 10% at H 4096's:
    jointly a return would win, but the joint boundaries serve the hidden sizes nobody measured (where
    the ring wins: bench_results/world_size_1/small_hidden/), so only H 4096's own return."""
    points = _world_one_window(256, 1024)
    for point, times in points.items():
        if point[0] == 7168 and point[3] == 4096:
            times["local"] = fit.Time(times["local_streaming"].median_us * 0.995, 0.0)
    result = fit.fit_cell_by_hidden(points, WORLD_ONE, key="bytes_per_rank", own_families=tuning.ladder_families(1))
    assert result.limits[1] == ALL
    assert [hidden for hidden, *_ in result.by_hidden] == [4096]
