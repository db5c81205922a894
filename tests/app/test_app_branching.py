"""Branching in the app on the tiny model: "continue from here" on a candidate in the probability
panel makes a new branch whose tokens equal a fresh request (greedy, fp32) and whose prefix
blocks come from the prefix cache; regenerate and edit-and-resend add siblings instead of
overwriting; the forks navigate (◀ 2/3 ▶) and the shown path survives a restart; a reply
keeps its stats and settings and can be regenerated with them."""

from __future__ import annotations

from app_windows import REPLY_TIMEOUT_MS, StepGate, wait_started

from engine.config import EngineConfig, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.events import RequestFinished
from engine.request import ChatMessage, Request

GREEDY = dict(temperature=0.0, ignore_eos=True, snapshot_top_n=8)


def use_params(window, **kw) -> SamplingParams:
    params = SamplingParams(**{**GREEDY, **kw})
    window.controls.sampling.set_params(params)
    return params


def finish(qtbot, window, start) -> RequestFinished:
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        assert start() is not False
    return finished.args[0]


def fresh_reply(tiny_loaded, messages, prefix, params) -> tuple[list[int], tuple[int, ...]]:
    """The prompt ids of `messages` + `prefix` and a fresh engine's reply to them (no cache)."""
    events: list = []
    engine = LLMEngine(tiny_loaded, EngineConfig(num_blocks=64, enable_prefix_caching=False), events.append)
    template = engine.prompt_ids(Request(messages=messages))
    engine.add_request(Request(prompt_token_ids=(*template, *prefix), sampling=params))
    while engine.has_work():
        engine.step()
    done = next(e for e in events if isinstance(e, RequestFinished))
    return template, done.token_ids


def test_continue_from_a_candidate_is_a_branch_equal_to_a_fresh_request_sharing_its_prefix(
    make_window, qtbot, tiny_loaded
):
    window = make_window()
    params = use_params(window, max_new_tokens=10)
    window.chat.system_prompt.setPlainText("You are terse. " * 4)  # the prompt spans full KV blocks
    first = finish(qtbot, window, lambda: window.controller.send("Name a colour and say why."))
    original = window.controller.conversation.messages[-1]

    # In the probability panel: token 4 of the reply, its second candidate (not the drawn one).
    window.chat.token_view.setChecked(True)
    window.controller.inspect_token(first.request_id, 4)
    panel = window.panels.probabilities
    drawn = first.token_ids[4]
    row = next(i for i, r in enumerate(panel.rows) if r.token_id != drawn)
    chosen = panel.rows[row].token_id
    panel.choose_candidate(row)
    assert panel.continue_button.isEnabled() and panel.chosen_candidate() == (first.request_id, 4, chosen)

    hits_before = window.host.live.steps[-1].prefix_hit_tokens  # cumulative, in every step's stats
    gate = StepGate(window.host.engine.core, after_steps=1)  # the branch's prefill step
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        panel.continue_button.click()
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        window.host.render_tick()
        branch_id = window.controller.active.record.request_id
        hits = window.host.live.steps[-1].prefix_hit_tokens - hits_before  # the branch's prefill step
        page_map = window.host.live.page_map
        shared_cached = [
            b for b in range(len(page_map.cached)) if page_map.cached[b] and branch_id in page_map.owners[b]
        ]
        gate.release()
    branch = finished.args[0]
    assert branch.request_id == branch_id

    # Its tokens are those of a fresh request whose prompt is the prefix plus the chosen token.
    system = ChatMessage("system", window.chat.system_prompt.toPlainText().strip())
    messages = (system, ChatMessage("user", "Name a colour and say why."))
    prefix = (*first.token_ids[:4], chosen)
    template, reference = fresh_reply(tiny_loaded, messages, prefix, params)
    assert branch.token_ids == reference
    # Its prefix blocks were served from the cache, shown in the page map and the step stats.
    block = window.host.engine.core.kv.block_size
    assert branch.stats.cached_prompt_tokens == (len(template) + 4) // block * block > 0
    assert len(shared_cached) == branch.stats.cached_prompt_tokens // block
    assert hits == branch.stats.cached_prompt_tokens

    # Stored as a second version of the reply, beside the first, and shown as such.
    conv = window.controller.conversation
    user = conv.messages[0]
    versions = conv.children(user.id)
    assert [m.id for m in versions] == [original.id, conv.messages[-1].id]
    stored = window.conversations.load(conv.id).nodes[versions[1].id]
    assert stored.token_ids == (*prefix, *branch.token_ids)
    assert stored.content.startswith(
        "".join(t.text_delta for t in window.controller.session.records[original.id].tokens[:4])
    )
    assert window.conversations.load(conv.id).nodes[original.id].content == original.content  # kept
    bubble = window.chat.transcript.bubbles[-1]
    assert (
        bubble.fork_position == (2, 2) and bubble.fork_prev.isEnabled() and not bubble.fork_next.isEnabled()
    )
    # The branch's first tokens show the reply they came from: the chosen one where it was cut.
    assert bubble.token_key(4) == (first.request_id, 4) and bubble.token_key(5) == (branch.request_id, 0)


def test_regenerate_and_edit_add_siblings_and_the_forks_navigate_and_persist(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=4)
    finish(qtbot, window, lambda: window.controller.send("First question"))
    first_reply = window.controller.conversation.messages[-1]
    use_params(window, max_new_tokens=6, temperature=0.8, seed=3)
    finish(qtbot, window, window.controller.regenerate)
    conv = window.controller.conversation
    user = conv.messages[0]
    assert [m.id for m in conv.children(user.id)] == [first_reply.id, conv.messages[-1].id]
    assert len(window.chat.transcript.bubbles) == 2

    reply_bubble = window.chat.transcript.bubbles[1]
    assert reply_bubble.fork_position == (2, 2) and reply_bubble.fork_label.text() == "2/2"
    reply_bubble.fork_prev.click()
    assert window.controller.conversation.messages[-1].id == first_reply.id
    assert window.chat.transcript.bubbles[1].text == first_reply.content

    # Edit the question: a second version of it, with its own reply; the first stays.
    window.controller.edit_message(user.id)
    assert window.chat.editing and window.chat.input.toPlainText() == "First question"
    window.chat.input.setPlainText("First question, rephrased")
    finish(qtbot, window, lambda: window.chat.send_button.click())
    conv = window.controller.conversation
    roots = conv.children(None)
    assert [m.content for m in roots] == ["First question", "First question, rephrased"]
    assert [m.content for m in conv.messages][0] == "First question, rephrased"
    assert window.chat.transcript.bubbles[0].fork_position == (2, 2)
    shown = [m.id for m in conv.messages]
    conv_id = conv.id
    window.close()

    again = make_window(start=False)
    assert [m.id for m in again.controller.conversation.messages] == shown  # the path is remembered
    again.chat.transcript.bubbles[0].fork_prev.click()  # back to the first question's line...
    texts = [b.text for b in again.chat.transcript.bubbles]
    assert texts[0] == "First question" and len(texts) == 2  # ...its newest reply (the regenerated one)
    assert len(again.conversations.load(conv_id).nodes) == 5  # nothing was overwritten


def test_a_reply_keeps_its_stats_and_settings_and_regenerates_with_them(make_window, qtbot):
    window = make_window()
    made_with = use_params(window, max_new_tokens=5, repetition_penalty=1.3)
    event = finish(qtbot, window, lambda: window.controller.send("Keep my settings"))
    reply = window.controller.conversation.messages[-1]
    stats = reply.meta["stats"]
    assert stats["generated_tokens"] == 5 == event.stats.generated_tokens
    assert stats["tokens_per_s"] == event.stats.tokens_per_s and stats["ttft_s"] == event.stats.ttft_s
    assert (
        stats["model"] == "tiny-random-llama" and stats["weights"] == "none" and stats["speculative"] is None
    )
    assert SamplingParams(**reply.meta["sampling"]) == made_with
    conv_id = window.controller.conversation.id
    window.close()

    again = make_window()
    again.controller.open_conversation(conv_id)
    bubble = again.chat.transcript.bubbles[-1]
    header = bubble._meta.text()
    assert "5 tokens" in header and "tok/s" in header and "TTFT" in header  # after a restart, from storage
    assert (
        "Model: tiny-random-llama" in bubble._meta.toolTip()
        and "repetition_penalty 1.3" in bubble._meta.toolTip()
    )
    use_params(again, max_new_tokens=9)  # the current settings differ...
    redo = finish(qtbot, again, lambda: again.controller.regenerate_message(reply.id, same_settings=True))
    assert len(redo.token_ids) == 5  # ...the reply's own were used
    assert again.controller.conversation.messages[-1].meta["sampling"]["repetition_penalty"] == 1.3


def test_branching_is_refused_with_a_reason_while_a_reply_streams(make_window, qtbot):
    window = make_window()
    use_params(window, max_new_tokens=4)
    first = finish(qtbot, window, lambda: window.controller.send("Hi"))
    use_params(window, max_new_tokens=2000)
    gate = StepGate(window.host.engine.core, after_steps=2)
    window.controller.send("Go on")
    wait_started(qtbot, window.controller)
    qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
    assert not window.controller.branch_from_token(first.request_id, 1, 5)
    assert "Wait for the reply" in window.status.error.text()
    gate.release()
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS):
        window.controller.stop()
