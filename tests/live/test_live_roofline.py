"""The live roofline: every StepStats the engine priced (its cost and LM-head rows) becomes one
point, folded in order so none is missed however rarely the plot redraws; a step without a cost
is not placed; a new model starts afresh; MFU/MBU are ratios of the summed counts and times."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hand_events import model_loaded

from engine.events import KVStats, StepCost, StepStats
from engine.units import mbu, mfu
from live.roofline import RooflinePoints, phase_of, phase_utilisation, point_from_step
from live.state import LiveState

KV = KVStats(64, 16, 1, 0, 63, 1, 1024, 64 * 1024)


def priced(n: int, prefill: int, decode: int, forward_s: float, rows: int, flops: float, nbytes: float):
    shapes = ((prefill, prefill),) if prefill else ()
    shapes += tuple((1, 100) for _ in range(decode))
    cost = StepCost(flops, nbytes * 0.9, nbytes * 0.08, nbytes * 0.02, {"flops_lm_head": 1.0})
    return StepStats(
        n, prefill, decode, len(shapes), len(shapes), 0, forward_s * 1.2, forward_s, 0.001, KV,
        seq_shapes=shapes, logit_rows=rows, kernel="fp32", cost=cost, t=float(n),
    )  # fmt: skip


def test_every_priced_step_is_one_point_with_the_engines_counts():
    state = LiveState()
    steps = [priced(i, 0, 4, 0.01, 4, 1e9, 5e8) for i in range(1, 1001)]  # more than RECENT_STEPS
    dirty = state.apply(steps)
    assert "roofline" in dirty and state.roofline.added == 1000
    assert len(state.steps) < 1000  # the recent steps are bounded; the points are not lost with them
    point = state.roofline.points[-1]
    assert (point.step, point.flops, point.bytes, point.logit_rows, point.forward_s) == (
        1000,
        1e9,
        5e8,
        4,
        0.01,
    )
    assert point.intensity == pytest.approx(2.0) and point.flops_per_s == pytest.approx(1e11)
    assert point.kernel == "fp32" and point.breakdown == {"flops_lm_head": 1.0}


def test_unpriced_or_timeless_steps_are_not_placed():
    unpriced = priced(1, 0, 1, 0.01, 1, 1e9, 5e8)
    assert point_from_step(replace(unpriced, cost=None)) is None
    assert point_from_step(replace(unpriced, forward_s=0.0)) is None
    state = LiveState()
    assert "roofline" not in state.apply([replace(unpriced, cost=None)])
    assert state.roofline.added == 0 and len(state.steps) == 1


def test_a_loaded_model_starts_the_points_afresh():
    state = LiveState()
    state.apply([priced(1, 8, 0, 0.02, 1, 1e9, 1e9)])
    assert len(state.roofline.points) == 1
    assert "roofline" in state.apply([model_loaded()])
    assert list(state.roofline.points) == [] and state.roofline.added == 0


def test_phases_and_their_utilisation():
    assert [phase_of(priced(1, p, d, 0.01, 1, 1.0, 1.0)) for p, d in ((8, 0), (0, 2), (8, 2))] == [
        "prefill",
        "decode",
        "mixed",
    ]
    points = RooflinePoints()
    for i, (flops, nbytes, seconds) in enumerate([(2e9, 1e9, 0.02), (1e9, 1e9, 0.01), (3e9, 2e9, 0.03)]):
        points.add(priced(i + 1, 0, 1, seconds, 1, flops, nbytes))
    points.add(priced(9, 16, 0, 0.05, 1, 8e9, 1e9))
    util = phase_utilisation(points.points, "decode", peak_flops=1e12, bandwidth=1e11, last_n=2)
    assert util.steps == 2
    assert util.mfu == mfu(4e9, 0.04, 1e12) and util.mbu == mbu(3e9, 0.04, 1e11)
    assert phase_utilisation(points.points, "mixed", 1e12, 1e11, 8) is None
