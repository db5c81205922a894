"""The real engine (tiny random Llama, real tokenizer) feeding the store and every panel."""

from __future__ import annotations

import time

import pytest
from hand_events import block_counts

from engine.config import EngineConfig
from engine.core.service import Engine
from engine.events import MemorySample, StepStats, TokenGenerated
from engine.request import Request
from live.event_store import EventStore
from live.state import LiveState
from widgets import theme
from widgets.kv_page_map import KVPageMapPanel
from widgets.latency_panel import LatencyPanel
from widgets.memory_panel import MemoryPanel
from widgets.probability_panel import ProbabilityPanel

SYSTEM = "You are a careful assistant. Answer in one short paragraph, and say so when you are unsure."
SAMPLING = dict(
    temperature=0.9, top_k=20, top_p=0.9, snapshot_top_n=8, max_new_tokens=20, ignore_eos=True, seed=3
)
WAIT_S = 120.0


@pytest.fixture
def engine_store(tiny_loaded):
    store = EventStore()
    engine = Engine(
        EngineConfig(block_size=4, num_blocks=96, max_model_len=512), sink=store.push, loaded=tiny_loaded
    )
    engine.start()
    assert engine.wait_until_loaded(60), engine.load_error
    yield engine, store
    engine.shutdown(30)
    assert not engine.is_alive()


def test_page_map_equals_engine_kv_stats_after_every_step(engine_store, qtbot):
    """Folding block events one by one reproduces the pool's own counters at every step."""
    engine, store = engine_store
    state = LiveState()
    first = engine.submit(Request.chat("What is a KV cache?", system=SYSTEM, **SAMPLING))
    events, checked = [], 0

    def fold_all() -> None:
        nonlocal checked
        for event in store.drain():
            events.append(event)
            state.apply([event])
            if isinstance(event, StepStats):
                assert block_counts(state.page_map) == block_counts(event.kv)
                checked += 1

    def finished(request_id) -> bool:
        fold_all()
        view = state.requests.get(request_id)
        return view is not None and view.done

    qtbot.waitUntil(lambda: finished(first), timeout=int(WAIT_S * 1000))
    # Same system prompt again: its full blocks come back from the prefix cache ("share").
    second = engine.submit(Request.chat("And what is paged attention?", system=SYSTEM, **SAMPLING))
    qtbot.waitUntil(lambda: finished(second), timeout=int(WAIT_S * 1000))
    assert checked >= 2 * SAMPLING["max_new_tokens"]
    assert any(getattr(e, "op", None) == "share" and e.seq_id == second for e in events)
    assert list(state.errors) == []  # the fold never contradicted itself
    assert state.page_map.used_blocks == 0 and state.page_map.cached_free_blocks > 0


def test_panels_show_used_blocks_during_generation_and_none_after(engine_store, qtbot):
    engine, store = engine_store
    state = LiveState()
    prob, kv, memory, latency = panels = [
        ProbabilityPanel(state),
        KVPageMapPanel(state),
        MemoryPanel(state),
        LatencyPanel(state),
    ]
    for panel in panels:
        qtbot.addWidget(panel)
        panel.resize(400, 300)
        panel.show()
    request_id = engine.submit(Request.chat("Write a haiku about the sea.", system=SYSTEM, **SAMPLING))
    seen: list = []
    lit_during_generation = []

    def frame() -> bool:
        batch = store.drain()
        seen.extend(batch)
        dirty = state.apply(batch)
        for panel in panels:
            panel.refresh(dirty)
        view = state.requests.get(request_id)
        if view is not None and not view.done and state.page_map.used_blocks:
            used = [b for b in range(kv.canvas.blocks_shown) if state.page_map.ref_count[b] > 0]
            image = kv.canvas.grab().toImage()
            x, y = kv.canvas.cell_center(used[0])
            color = image.pixelColor(x - kv.canvas._grid[2] // 2 + 2, y)
            lit_during_generation.append((color.red(), color.green(), color.blue()) != theme.BLOCK_FREE)
        return view is not None and view.done

    qtbot.waitUntil(frame, timeout=int(WAIT_S * 1000))
    # Let at least one more memory sample arrive after the reply, then draw a last frame.
    deadline = time.monotonic() + 5.0
    while not any(isinstance(e, MemorySample) for e in seen) and time.monotonic() < deadline:
        qtbot.wait(50)
        frame()

    # Throttled panels (probabilities, latency) draw what they deferred on a later frame.
    qtbot.wait(150)
    frame()
    assert lit_during_generation and all(lit_during_generation)
    assert state.requests[request_id].status == "length"
    assert state.page_map.used_blocks == 0
    assert "<b>0</b> used" in kv.counters.text()

    tokens = [e for e in seen if isinstance(e, TokenGenerated)]
    assert len(tokens) == SAMPLING["max_new_tokens"]
    assert latency.point_count() == len(tokens)

    last = tokens[-1].snapshot
    assert [r.prob for r in prob.rows] == list(last.stages[-1].probs)
    assert [r.raw_prob for r in prob.rows] == list(last.stages[0].probs)
    prob.show_token(request_id, 0)
    assert [r.prob for r in prob.rows] == list(tokens[0].snapshot.stages[-1].probs)

    samples = [e for e in seen if isinstance(e, MemorySample)]
    assert len(memory.series("process")[0]) == len(samples) >= 1
