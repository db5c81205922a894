"""The load tool on the tiny model: N requests at once through the app's engine host."""

from __future__ import annotations

import pytest
from app_windows import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS

from app.batching.load_run import LoadSpec, build_requests
from app.batching.load_tool import LoadToolPanel
from app.engine_host import EngineHost
from engine.config import EngineConfig


@pytest.fixture
def host(qtbot, tiny_loaded):
    host = EngineHost()
    with qtbot.waitSignal(host.model_loaded, timeout=LOAD_TIMEOUT_MS):
        host.start(EngineConfig(block_size=4, num_blocks=256, max_model_len=512), loaded=tiny_loaded)
    yield host
    assert host.shutdown(30)


def test_shared_and_distinct_system_prompts():
    shared = build_requests(LoadSpec(3, True, 10, 5, 4))
    distinct = build_requests(LoadSpec(3, False, 10, 5, 4))
    assert len({r.messages[0].content for r in shared}) == 1
    assert len({r.messages[0].content for r in distinct}) == 3
    assert len({r.messages[-1].content for r in shared}) == 3  # each user turn is its own
    assert all(r.sampling.max_new_tokens == 4 for r in shared + distinct)


def test_load_tool_runs_n_requests_to_the_end_and_plots_a_point(qtbot, host):
    panel = LoadToolPanel(host)
    qtbot.addWidget(panel)
    panel.count.setValue(4)
    panel.new_tokens.setValue(12)
    panel.system_words.setValue(60)
    panel.shared.setChecked(True)
    assert panel.run_button.isEnabled()
    with qtbot.waitSignal(panel.runner.run_finished, timeout=REPLY_TIMEOUT_MS):
        panel.run_button.click()
        assert panel.cancel_button.isEnabled()
    run = panel.runner.run
    rows = list(run.requests.values())
    assert len(rows) == 4
    assert all(r.status == "length" and r.generated == 12 for r in rows)
    assert all(r.finished.stats.ttft_s > 0 and len(r.finished.stats.itl_s) == 11 for r in rows)
    assert panel.table.rowCount() == 4
    assert panel.table.item(0, 2).text() == "12 / 12"
    assert panel.progress.value() == panel.progress.maximum() == 48
    assert len(panel.throughput.points) == 1
    point = panel.throughput.points[0]
    assert point.concurrency == 4 and point.total_tokens_per_s > 0 and point.median_itl_s > 0
    assert "tokens/s in total" in panel.summary.text()
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()

    # Requests admitted in one step cannot share blocks not yet committed; a second run finds
    # the shared system prompt's blocks in the prefix cache, and the table says how many.
    with qtbot.waitSignal(panel.runner.run_finished, timeout=REPLY_TIMEOUT_MS):
        panel.run_button.click()
    second = list(panel.runner.run.requests.values())
    assert all(r.finished.stats.cached_prompt_tokens > 0 for r in second)
    cached = second[0].finished.stats
    assert panel.table.item(0, 5).text() == f"{cached.cached_prompt_tokens} of {cached.prompt_tokens}"
    assert len(panel.throughput.points) == 2


def test_load_tool_cancel_ends_every_request_without_a_point(qtbot, host):
    panel = LoadToolPanel(host)
    qtbot.addWidget(panel)
    panel.count.setValue(3)
    panel.new_tokens.setValue(2000)
    panel.run_button.click()
    qtbot.waitUntil(
        lambda: any(r.generated > 0 for r in panel.runner.run.requests.values()), timeout=REPLY_TIMEOUT_MS
    )
    with qtbot.waitSignal(panel.runner.run_finished, timeout=REPLY_TIMEOUT_MS):
        panel.cancel_button.click()
    assert {r.status for r in panel.runner.run.requests.values()} == {"cancelled"}
    assert panel.throughput.points == []
    assert panel.run_button.isEnabled()


def test_load_tool_without_a_model_says_so(qtbot):
    host = EngineHost()
    panel = LoadToolPanel(host)
    qtbot.addWidget(panel)
    assert not panel.run_button.isEnabled()
    assert panel.start_run() is None
    assert "no model is loaded" in panel.summary.text()


def _stats(prompt: int, cached: int, ttft_s: float):
    from engine.events import RequestStats

    return RequestStats(
        prompt_tokens=prompt, generated_tokens=4, cached_prompt_tokens=cached, ttft_s=ttft_s,
        itl_s=(0.01,) * 3, tokens_per_s=10.0, preemptions=0, peak_blocks=2,
    )  # fmt: skip


def test_prefix_cache_note_names_cached_tokens_and_the_uncached_turn():
    from app.prefix_ttft import first_uncached, prefix_cache_note

    first, second = _stats(30, 0, 0.8), _stats(430, 412, 0.12)
    assert first_uncached([None, second, first]) is first
    assert prefix_cache_note(first, None) == ""
    assert prefix_cache_note(second, first) == (
        "412 of 430 prompt tokens from the prefix cache; uncached turn 800 ms (30 tokens)"
    )


def test_follow_up_turn_shows_its_cached_ttft_beside_the_uncached_one(make_window, qtbot):
    from engine.config import SamplingParams

    window = make_window()
    assert {"load_tool", "step_timeline"} <= set(window.docks)
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=20))
    window.chat.system_prompt.setPlainText(
        "You are a patient assistant who explains rivers, valleys and erosion in plain words."
    )
    finished = []
    for text in ("How does a river carve a valley?", "And why does it bend?"):
        with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as signal:
            window.controller.send(text)
        finished.append(signal.args[0].stats)
    first, second = finished
    assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens > 0
    bubbles = [b for b in window.chat.transcript.bubbles if getattr(b, "request_id", None) is not None]
    first_meta, second_meta = (b._meta.text() for b in bubbles[-2:])
    assert "prefix cache" not in first_meta
    assert (
        f"TTFT {second.ttft_s * 1000:.0f} ms ({second.cached_prompt_tokens} of {second.prompt_tokens} "
        f"prompt tokens from the prefix cache; uncached turn {first.ttft_s * 1000:.0f} ms"
    ) in second_meta


def test_two_chat_tabs_generate_at_once_each_in_its_own_colour(make_window, qtbot):
    from app_windows import StepGate, wait_started

    from engine.config import SamplingParams
    from widgets import theme

    window = make_window()
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=16))
    tabs = window.chat_tabs
    second = tabs.add_tab()
    assert tabs.count() == 2 and tabs.currentIndex() == 1
    core = window.host.engine.core
    # the second request reaches the engine a little after the first: count from the step
    # both run in (a fast first reply could be 4 steps along before the second is added)
    gate = StepGate(core, after_steps=2, when=lambda: len(core.scheduler.running) >= 2)
    finished = []
    window.host.request_finished.connect(finished.append)
    window.controller.send("Tell me about rivers.")
    second.send("Tell me about mountains.")
    wait_started(qtbot, window.controller, second)
    first_id, second_id = tabs.active_request_ids()
    assert first_id is not None and second_id is not None and first_id != second_id
    qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
    window.host.render_tick()
    page_map = window.host.live.page_map
    owners = {int(o) for o in page_map.first_owner[page_map.ref_count > 0]}
    gate.release()
    assert {first_id, second_id} <= owners, "both tabs' sequences hold blocks in the page map"
    # Each tab wears its sequence's page-map colour while generating.
    for index, request_id in enumerate((first_id, second_id)):
        icon = tabs.tabIcon(index).pixmap(8, 8).toImage().pixelColor(4, 4)
        assert (icon.red(), icon.green(), icon.blue()) == theme.seq_rgb(request_id)
    qtbot.waitUntil(lambda: len(finished) == 2, timeout=REPLY_TIMEOUT_MS)
    assert {e.request_id for e in finished} == {first_id, second_id}
    assert all(e.stats.generated_tokens == 16 for e in finished)
    for controller in tabs.controllers:
        assert controller.active is None
        replies = [m for m in controller.conversation.messages if m.role == "assistant"]
        assert len(replies) == 1 and replies[0].content and replies[0].finish_reason == "length"
    assert tabs.active_request_ids() == [None, None] and tabs.tabIcon(1).isNull()
    # The second tab's conversation is stored like any other and listed in the sidebar.
    stored = {s.id for s in window.conversations.summaries()}
    assert {c.conversation.id for c in tabs.controllers} <= stored
    assert len({c.conversation.id for c in tabs.controllers}) == 2
    tabs.close_tab(1)
    assert tabs.count() == 1


def test_a_closed_tab_hears_nothing_more_from_the_engine(make_window, qtbot):
    """The host and the engine outlive a closed tab: neither a frame, a reply of another tab nor
    an answer the tab asked for before closing reaches its deleted widgets."""
    window = make_window()
    tabs = window.chat_tabs
    second = tabs.add_tab()
    second.pane.input.setPlainText("a draft the meter is counting")
    second.context.measure_now()  # its answer is on the way when the tab closes
    tabs.close_tab(1)
    qtbot.wait(300)  # the deferred deletions, and the engine's answer
    window.host.frame.emit({"kv", "model"})
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.controller.send("Tell me about rivers.")
    assert tabs.count() == 1 and window.controller.conversation.messages[-1].content
