"""n samples and beam search through the whole app on the tiny model: the chat streams the
samples side by side or draws the beams, any alternative can be kept (stored, reopened, continued
from), stop works, and the page map shows the group's shared blocks and its memory saving."""

from __future__ import annotations

import numpy as np
from app_windows import REPLY_TIMEOUT_MS, StepGate, stop_on_first_tokens
from test_app_chat import send_and_wait, stored_messages, use_params

from app.chat.group_reply import GroupReply
from app.chat.group_reply_view import GroupReplyCard
from live.state import DIRTY_KEYS
from widgets.beam_tree import format_score

# 33 prompt tokens with the SmolLM2 chat template: the last prompt block is partly filled, so
# the samples' first writes copy it (copy-on-write) instead of writing into the shared block.
PARTIAL_BLOCK_PROMPT = "Pick a word"


def last_card(window) -> GroupReplyCard:
    card = window.chat.transcript.bubbles[-1]
    assert isinstance(card, GroupReplyCard)
    return card


def stored_meta(window):
    return window.conversations.load(window.controller.conversation.id).messages[-1].meta


def test_n_samples_stream_side_by_side_and_the_kept_one_is_the_reply(make_window, qtbot, monkeypatch):
    window = make_window()
    use_params(window, temperature=0.9, n=3, seed=11, max_new_tokens=8)
    gate = StepGate(window.host.engine.core, after_steps=4)  # prefill + 3 decode steps
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send("Say three things")
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        window.host.render_tick()
        streaming = {b: c.text for b, c in last_card(window).cards.items()}
        gate.release()
    event = finished.args[0]

    final = {s.branch: s.text for s in event.sequences}
    assert sorted(final) == [0, 1, 2] and len(set(final.values())) > 1  # three different samples
    assert all(streaming[b] and final[b].startswith(streaming[b]) for b in final)  # each streamed
    card = last_card(window)
    assert {b: c.text for b, c in card.cards.items()} == final
    # The engine's best (sequences[0]) is the reply until another is kept.
    assert stored_messages(window)[-1] == ("assistant", event.text, event.finish_reason)
    assert card.cards[event.sequences[0].branch].kept

    card.cards[1].keep_button.click()
    assert stored_messages(window)[-1][:2] == ("assistant", final[1])
    assert GroupReply.from_meta(stored_meta(window)).kept == 1 and card.cards[1].kept
    assert card.text == final[1] and not card.cards[0].kept

    # The next turn continues from the kept sample; the earlier card can no longer change.
    submitted = []
    original = window.host.submit
    monkeypatch.setattr(window.host, "submit", lambda request: submitted.append(request) or original(request))
    use_params(window, max_new_tokens=3)
    send_and_wait(qtbot, window, "And then?")
    assert [(m.role, m.content) for m in submitted[0].messages][1] == ("assistant", final[1])
    assert not card.cards[0].keep_button.isEnabled()

    window.close()
    again = make_window(start=False)
    restored = again.chat.transcript.bubbles[1]
    assert isinstance(restored, GroupReplyCard) and restored.text == final[1]
    assert restored.cards[1].kept and {b: c.text for b, c in restored.cards.items()} == final


def test_beam_search_shows_its_beams_as_a_tree_then_ranked_with_scores(make_window, qtbot):
    window = make_window()
    use_params(window, num_beams=3, max_new_tokens=5)
    event = send_and_wait(qtbot, window, "Hi there")
    window.host.render_tick()

    card = last_card(window)
    ranked = [(s.branch, s.text) for s in event.sequences]
    assert [(b, c.text) for b, c in card.cards.items()] == ranked and len(ranked) == 3
    for seq in event.sequences:
        assert format_score(seq.score) in card.cards[seq.branch]._facts.text()
    steps = window.host.live.groups[event.request_id].beam_steps
    assert len(steps) == 5 and steps[-1].done
    slots = [(n.step, n.row) for n in card.tree.nodes if not n.finished]
    assert slots == [(s, j) for s in range(len(steps)) for j in range(len(steps[s].token_ids))]
    assert sum(n.finished for n in card.tree.nodes) == sum(len(s.finished) for s in steps)

    assert stored_messages(window)[-1][:2] == ("assistant", event.sequences[0].text)  # the best
    card.cards[2].keep_button.click()
    assert stored_messages(window)[-1][1] == event.sequences[2].text
    card.cards[0].keep_button.click()
    assert stored_messages(window)[-1][1] == event.sequences[0].text
    assert GroupReply.from_meta(stored_meta(window)).kept == 0


def test_the_page_map_shows_the_groups_shared_blocks_and_its_saving(make_window, qtbot):
    window = make_window()
    use_params(window, temperature=0.9, n=4, seed=3, max_new_tokens=6)
    panel = window.panels.page_map
    gate = StepGate(window.host.engine.core, after_steps=3)
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send(PARTIAL_BLOCK_PROMPT)
        qtbot.waitUntil(gate.reached.is_set, timeout=REPLY_TIMEOUT_MS)
        window.host.render_tick()
        panel.refresh(DIRTY_KEYS)
        pm = window.host.live.page_map
        shared_refs = int(pm.ref_count.max())
        copies = int(np.count_nonzero((pm.ref_count > 0) & (pm.copied_from >= 0)))
        live_line = panel.group_line.text()
        owners = {window.host.live.seq_label(int(s)) for s in np.unique(pm.first_owner[pm.ref_count > 0])}
        gate.release()
    event = finished.args[0]

    assert shared_refs == 4  # the prompt's full block, held by all four samples
    assert copies == 3  # three forks copied the shared, partly filled last prompt block
    rid = event.request_id
    assert owners == {f"#{rid} sample {i}" for i in range(1, 5)}  # each sample its own colour
    assert live_line.startswith(f"group #{rid} (4 samples, now)")
    window.host.render_tick()
    panel.refresh(DIRTY_KEYS)
    assert window.host.live.page_map.used_blocks == 0  # all freed at the end
    stats = event.group
    assert stats.cow_copies == 3
    assert panel.group_line.text() == (
        f"group #{rid} (4 samples, peak): {stats.shared_blocks} blocks shared vs "
        f"{stats.unshared_blocks_equivalent} unshared (saving {stats.saving * 100:.0f}%), 3 copy-on-write"
    )


def test_stop_cancels_the_whole_group_and_keeps_the_partial_samples(make_window, qtbot):
    window = make_window()
    use_params(window, temperature=0.9, n=2, max_new_tokens=2000)
    stop_on_first_tokens(window)
    event = send_and_wait(qtbot, window, "Count to a million")
    assert event.finish_reason == "cancelled" and len(event.sequences) == 2
    assert all(0 < len(s.token_ids) < 2000 for s in event.sequences)
    card = last_card(window)
    assert {b: c.text for b, c in card.cards.items()} == {s.branch: s.text for s in event.sequences}
    assert stored_messages(window)[-1] == ("assistant", event.text, "cancelled")
    assert window.chat.send_button.isEnabled() and window.host.live.page_map.used_blocks == 0
