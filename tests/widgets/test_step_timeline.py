"""Step timeline: prefill and decode tokens per step from the real engine, preemptions marked."""

from __future__ import annotations

import time

import numpy as np

from engine.config import EngineConfig
from engine.core.service import Engine
from engine.events import KVStats, RequestFinished, StepStats
from engine.request import Request
from live.event_store import EventStore
from live.state import LiveState
from widgets.step_timeline import StepTimelinePanel, timeline_series

WAIT_S = 120.0
LONG_PROMPT = " ".join(f"Fact {i}: the river bends west after the old mill." for i in range(20))


def _kv() -> KVStats:
    return KVStats(
        num_blocks=8, block_size=4, used_blocks=0, cached_free_blocks=0, free_blocks=8, used_slots=0,
        bytes_per_block=1, pool_bytes=8,
    )  # fmt: skip


def _step(step: int, prefill: int, decode: int, preemptions: int) -> StepStats:
    return StepStats(
        step=step, prefill_tokens=prefill, decode_tokens=decode, num_seqs=1, running=1, waiting=0,
        duration_s=0.0, forward_s=0.0, sample_s=0.0, kv=_kv(), preemptions=preemptions,
    )  # fmt: skip


def test_series_takes_each_steps_own_preemptions_from_the_cumulative_count():
    steps = [_step(5, 8, 0, 2), _step(6, 4, 1, 2), _step(7, 0, 2, 3), _step(8, 0, 2, 5)]
    series = timeline_series(steps, previous_preemptions=1)
    assert series.preempted.tolist() == [1, 0, 1, 2]
    assert series.mixed_steps == 1
    # Without the count before the window, the first step cannot be attributed: taken as none.
    assert timeline_series(steps).preempted.tolist() == [0, 0, 1, 2]


def test_chunked_prefill_beside_a_decode_shows_mixed_steps(qtbot, tiny_loaded):
    store = EventStore()
    config = EngineConfig(block_size=4, num_blocks=128, max_model_len=512, prefill_chunk_size=8)
    engine = Engine(config, sink=store.push, loaded=tiny_loaded)
    engine.start()
    try:
        assert engine.wait_until_loaded(60), engine.load_error
        sampling = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        engine.submit(Request.chat("Hi.", **sampling))
        engine.submit(Request.chat(LONG_PROMPT, **sampling))
        state = LiveState()
        panel = StepTimelinePanel(state)
        qtbot.addWidget(panel)
        finished = 0
        deadline = time.monotonic() + WAIT_S
        while finished < 2 and time.monotonic() < deadline:
            events = store.drain()
            finished += sum(isinstance(e, RequestFinished) for e in events)
            panel.refresh(state.apply(events))
            qtbot.wait(20)
        assert finished == 2
    finally:
        engine.shutdown(30)
    panel.refresh({"steps"})
    series = panel.series
    steps = list(state.steps)
    assert len(series) == len(steps)
    # The chunk cap holds every step's prefill for one sequence to 8 tokens (two sequences: 16).
    assert series.prefill.max() <= 16
    assert series.mixed_steps >= 1, "the long prompt's chunks never ran beside the short reply's decodes"
    # Bars are exactly the engine's figures, the decode bar stacked on the prefill bar.
    opts = panel.decode_bars.opts
    assert np.array_equal(opts["y0"], series.prefill)
    assert np.array_equal(opts["height"], [s.decode_tokens for s in steps])
    assert sum(s.decode_tokens for s in steps) + 2 == 48  # each reply's first token comes from prefill
    assert "mixed prefill with decode" in panel.readout.text()
