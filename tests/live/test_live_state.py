"""The GUI-side fold: exact page-map states, counters, ring buffers, request bookkeeping."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hand_events import finished, model_loaded, token

from engine.events import (
    BlockEvent,
    EngineError,
    KVStats,
    MemorySample,
    RequestFailed,
    RequestStarted,
    StepStats,
    TokenGenerated,
)
from live.event_store import EventStore
from live.page_map import PageMap
from live.ring_buffer import RingBuffer
from live.state import LiveState


def block_state(pm: PageMap, block: int) -> tuple:
    return (
        int(pm.ref_count[block]),
        sorted(pm.owners[block]),
        int(pm.fill[block]),
        bool(pm.cached[block]),
        pm.token_range(block),
    )


def test_event_store_drains_in_order_across_threads():
    store = EventStore()

    def produce(offset):
        for i in range(500):
            store.push((offset, i))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads) or len(store):
        seen.extend(store.drain())
    for t in threads:
        t.join()
    seen.extend(store.drain())
    assert len(seen) == 2000
    for k in range(4):
        assert [i for off, i in seen if off == k] == list(range(500))
    assert store.drain() == []


def test_page_map_allocate_append_share_free_cache_evict_exact_states():
    pm = PageMap(num_blocks=6, block_size=4, bytes_per_block=100)
    # Sequence 1: a 6-token prompt in blocks 0 and 1.
    pm.apply(BlockEvent("allocate", (0, 1), 1))
    assert block_state(pm, 0) == (1, [1], 0, False, None)
    pm.apply(BlockEvent("append", (0, 1), 1, 0, 6, fills=(4, 2)))
    assert block_state(pm, 0) == (1, [1], 4, False, (0, 4))
    assert block_state(pm, 1) == (1, [1], 2, False, (4, 6))
    # One decode token lands in block 1.
    pm.apply(BlockEvent("append", (1,), 1, 6, 7, fills=(3,)))
    assert block_state(pm, 1) == (1, [1], 3, False, (4, 7))
    pm.apply(BlockEvent("cache", (0,), 1, 0, 4))
    assert block_state(pm, 0) == (1, [1], 4, True, (0, 4))
    # Sequence 2 shares the cached prefix block and gets a fresh block of its own.
    pm.apply(BlockEvent("share", (0,), 2, 0, 4, fills=(4,)))
    pm.apply(BlockEvent("allocate", (2,), 2))
    pm.apply(BlockEvent("append", (2,), 2, 4, 5, fills=(1,)))
    assert block_state(pm, 0) == (2, [1, 2], 4, True, (0, 4))
    assert block_state(pm, 2) == (1, [2], 1, False, (4, 5))
    assert (pm.used_blocks, pm.shared_blocks, pm.cached_free_blocks, pm.free_blocks) == (3, 1, 0, 3)
    assert pm.used_slots == 4 + 3 + 1
    assert pm.utilisation == pytest.approx(8 / 12)
    assert (pm.used_bytes, pm.pool_bytes) == (300, 600)
    # Sequence 1 finishes: its tail block empties, the shared prefix keeps one reference.
    pm.apply(BlockEvent("free", (1, 0), 1))
    assert block_state(pm, 1) == (0, [], 0, False, None)
    assert block_state(pm, 0) == (1, [2], 4, True, (0, 4))
    # Sequence 2 finishes: block 0 becomes cached-free and keeps its contents.
    pm.apply(BlockEvent("free", (2, 0), 2))
    assert block_state(pm, 0) == (0, [], 4, True, (0, 4))
    assert (pm.used_blocks, pm.cached_free_blocks, pm.free_blocks, pm.used_slots) == (0, 1, 6, 0)
    assert pm.utilisation == 1.0
    # A new sequence takes the cached block for new data: evicted, then allocated.
    pm.apply(BlockEvent("evict", (0,), 3))
    pm.apply(BlockEvent("allocate", (0,), 3))
    assert block_state(pm, 0) == (1, [3], 0, False, None)
    assert pm.cached_free_blocks == 0
    assert pm.first_owner.tolist() == [3, -1, -1, -1, -1, -1]


def test_page_map_derives_fill_from_token_range_when_fills_are_absent():
    pm = PageMap(num_blocks=4, block_size=4)
    pm.apply(BlockEvent("allocate", (2, 3), 7))
    pm.apply(BlockEvent("append", (2, 3), 7, 0, 6))
    assert (pm.fill[2], pm.fill[3]) == (4, 2)
    pm.apply(BlockEvent("append", (3,), 7, 6, 8))
    assert pm.token_range(3) == (4, 8)


def test_page_map_reports_contradictions_instead_of_going_negative():
    state = LiveState()
    state.apply([model_loaded(num_blocks=4, block_size=4)])
    dirty = state.apply([BlockEvent("free", (1,), 5)])
    assert dirty == {"kv", "errors"}
    assert state.page_map.ref_count[1] == 0
    assert "block 1 freed while not referenced" in state.errors[-1]


def test_model_loaded_resets_page_map_to_the_pool_size():
    state = LiveState()
    state.apply([model_loaded(num_blocks=8, block_size=16, pool_bytes=8 * 4096)])
    state.apply([BlockEvent("allocate", (0,), 1)])
    assert state.page_map.used_blocks == 1
    dirty = state.apply([model_loaded(num_blocks=3, block_size=4, pool_bytes=3 * 512)])
    assert {"model", "kv"} <= dirty
    pm = state.page_map
    assert (pm.num_blocks, pm.block_size, pm.bytes_per_block, pm.used_blocks) == (3, 4, 512, 0)


def test_ring_buffer_wraps_and_keeps_order_without_copies():
    ring = RingBuffer(4, ("a", "b"))
    for i in range(3):
        ring.append(a=i, b=10 * i)
    assert ring.column("a").tolist() == [0, 1, 2]
    for i in range(3, 10):
        ring.append(a=i)
    assert len(ring) == 4 and ring.appended == 10
    assert ring.column("a").tolist() == [6, 7, 8, 9]
    assert np.isnan(ring.column("b")).all()  # missing columns are NaN, not stale values
    assert ring.column("a").base is not None  # a view into the preallocated storage
    assert ring.holds(9) and ring.holds(6) and not ring.holds(5)
    ring.set(7, "a", 70)
    assert ring.column("a").tolist() == [6, 70, 8, 9]


def test_tokens_fill_latency_rows_with_ttft_then_itl():
    state = LiveState()
    state.apply([RequestStarted(1, prompt_tokens=5, t=10.0)])
    dirty = state.apply([token(1, 0, t=10.3), token(1, 1, t=10.35), token(1, 2, t=10.45)])
    assert dirty == {"tokens", "latency", "requests"}
    lat = state.latency
    assert lat.column("x").tolist() == [0, 1, 2]
    assert lat.column("latency_ms") == pytest.approx([300.0, 50.0, 100.0])
    assert lat.column("is_first").tolist() == [1, 0, 0]
    # Rolling rate: tokens since the engine became busy (at 10.0), as the window is not yet full.
    assert lat.column("tokens_per_s") == pytest.approx([1 / 0.3, 2 / 0.35, 3 / 0.45])
    assert state.token().index == 2
    assert state.token(1, 0).t == 10.3
    assert state.token(1, 3) is None


def test_engine_ttft_replaces_the_live_estimate_when_the_request_finishes():
    state = LiveState()
    state.apply([RequestStarted(1, 5, t=1.0), token(1, 0, t=1.2), token(1, 1, t=1.3)])
    dirty = state.apply([finished(1, "stop", ttft_s=0.25, itl_s=(0.1,), t=1.31)])
    assert "latency" in dirty
    assert state.latency.column("latency_ms") == pytest.approx([250.0, 100.0])
    view = state.requests[1]
    assert view.status == "stop" and view.done and len(view.tokens) == 2


def test_interleaved_requests_keep_their_own_itl():
    state = LiveState()
    state.apply(
        [
            RequestStarted(1, 3, t=0.0),
            RequestStarted(2, 3, t=0.0),
            token(1, 0, t=0.1),
            token(2, 0, t=0.1),
            token(1, 1, t=0.2),
            token(2, 1, t=0.25),
        ]
    )
    lat = state.latency
    assert lat.column("request_id").tolist() == [1, 2, 1, 2]
    assert lat.column("latency_ms") == pytest.approx([100.0, 100.0, 100.0, 150.0])
    assert state.latest_request_id == 2


def test_failures_and_engine_errors_are_kept_as_messages():
    state = LiveState()
    state.apply([RequestStarted(4, 1, t=0.0)])
    dirty = state.apply([RequestFailed(4, "out of KV blocks"), EngineError("step failed: boom")])
    assert dirty == {"requests", "errors"}
    assert list(state.errors) == ["request 4 failed: out of KV blocks", "step failed: boom"]
    assert state.requests[4].status == "failed"


def test_memory_samples_and_steps_are_recorded():
    state = LiveState()
    kv = KVStats(8, 16, 2, 1, 6, 20, 1024, 8192)
    samples = [
        MemorySample(100, 8192, 2048 * i, 10_000 + i, 10_000 + i, 1 << 30, "psutil RSS", t=i)
        for i in range(5)
    ]
    dirty = state.apply([*samples, StepStats(1, 4, 0, 1, 1, 0, 0.01, 0.008, 0.001, kv, t=5.0)])
    assert dirty == {"memory", "steps", "kv"}
    assert state.memory.column("kv_used").tolist() == [0, 2048, 4096, 6144, 8192]
    assert state.memory_source == "psutil RSS"
    assert state.kv_stats is kv and len(state.steps) == 1


def test_unknown_events_are_ignored_and_origin_is_the_first_event_time():
    state = LiveState()
    assert state.apply(
        [object(), RequestStarted(1, 1, t=42.0), TokenGenerated(1, 0, 5, "a", "a", -0.1, t=43.0)]
    )
    assert state.origin_t == 42.0


def test_a_restarted_engine_reusing_request_ids_starts_fresh_views():
    state = LiveState()
    state.apply([RequestStarted(1, 3, t=0.0), token(1, 0, t=0.1), token(1, 1, t=0.2)])
    state.apply([RequestStarted(1, 4, t=5.0), token(1, 0, t=5.5)])
    view = state.requests[1]
    assert (view.prompt_tokens, len(view.tokens), view.status) == (4, 1, "running")
    assert state.latency.value(view.first_token_row, "latency_ms") == pytest.approx(500.0)


def test_rolling_rate_uses_a_one_second_window_and_restarts_after_idle():
    state = LiveState()
    events = [RequestStarted(1, 3, t=0.0)] + [token(1, i, t=0.1 * (i + 1)) for i in range(20)]
    events += [finished(1, "length", 0.1, (0.1,) * 19, t=2.0)]
    # After 10 s idle a new request: its first token's rate counts from its own arrival.
    events += [RequestStarted(2, 3, t=12.0), token(2, 0, t=12.5)]
    state.apply(events)
    rate = state.latency.column("tokens_per_s")
    assert rate[19] == pytest.approx(16 / 1.6)  # the last 16 tokens span more than the 1 s window
    assert rate[20] == pytest.approx(1 / 0.5)


def test_rolling_rate_of_slow_irregular_tokens_is_smooth():
    state = LiveState()
    gaps = [0.3, 0.7] * 20
    times = np.cumsum([0.5, *gaps])
    state.apply([RequestStarted(1, 3, t=0.0)] + [token(1, i, t=float(t)) for i, t in enumerate(times)])
    rate = state.latency.column("tokens_per_s")
    # 16 tokens always span 8 s here; a 1 s window alone would read 1, 2, 1, 2 ...
    assert rate[16:] == pytest.approx([2.0] * (len(times) - 16))


def test_rolling_rate_of_fast_tokens_uses_the_one_second_window():
    state = LiveState()
    times = [0.01 * (i + 1) for i in range(300)]  # 100 tokens/s for 3 s
    state.apply([RequestStarted(1, 3, t=0.0)] + [token(1, i, t=t) for i, t in enumerate(times)])
    assert state.latency.column("tokens_per_s")[-1] == pytest.approx(100.0, rel=0.02)


def test_a_replays_sequence_is_named_as_an_inspection_and_a_groups_forks_are_not():
    from engine.core.group_driver import FORK_SEQ_ID_BASE
    from engine.core.replay import REPLAY_SEQ_IDS

    state = LiveState()
    replay = next(REPLAY_SEQ_IDS)
    assert state.seq_label(replay) == "an inspection of a token (its context replayed)"
    assert state.seq_label(3) == "#3"
    assert state.seq_label(FORK_SEQ_ID_BASE) == f"#{FORK_SEQ_ID_BASE}"  # not a replay
