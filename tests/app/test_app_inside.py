"""The views of the model's inside in the window, on the tiny model: pinning a token of a reply
recomputes its step on the engine thread and the logit lens and the attention grid draw the
engine's numbers (a hover asks nothing), the page map outlines the blocks the chosen head's layer
read; a dense model's expert panel says it has none; a pasted text is scored (and one past the
context refused with its count); a control vector file steers the pinned token's distribution (and
one of the wrong width is refused); nothing is a traceback."""

from __future__ import annotations

import threading

import pytest
import torch
from test_app_chat import send_and_wait, use_params

from engine.core import inside_token as inside_module
from engine.core.scoring import score_text
from engine.inside import ControlVector
from engine.model.control_vector import write_control_vector

TIMEOUT_MS = 60_000


def pinned_reply(qtbot, window, index: int = 2):
    use_params(window, max_new_tokens=6)
    finished = send_and_wait(qtbot, window, "Name a colour.")
    window.host.render_tick()
    window.controller.inspect_token(finished.request_id, index)
    return finished


def lens_answer_is_the_steps(views) -> bool:
    """The strip checks its last layer against the drawing step's own (kept) logits and says how
    close it is: float32 prefill chunks other than the reply's round K/V's last bits otherwise."""
    lens = views.lens.cells.lens
    title = views.lens.title.text()
    said = (
        "the step's own logits, to the bit"
        if lens.last_gap == 0.0
        else f"within {lens.last_gap:.2g} of the step's"
    )
    return lens.against_the_step and lens.last_gap < 1e-5 and said in title


def test_a_pinned_token_shows_its_lens_and_every_heads_attention(make_window, qtbot, monkeypatch):
    window = make_window()
    threads, calls = [], []
    original = inside_module.inside_token

    def spy(core, request, output_ids, token_id, top_k=5):
        threads.append(threading.current_thread().name)
        calls.append((tuple(output_ids), token_id))
        return original(core, request, output_ids, token_id, top_k)

    monkeypatch.setattr(inside_module, "inside_token", spy)
    finished = pinned_reply(qtbot, window)
    views = window.inside
    qtbot.waitUntil(lambda: views.lens.cells.lens is not None, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: views.attention.grid.attention is not None, timeout=TIMEOUT_MS)
    assert threads == ["kvscope-engine"]
    assert calls == [(tuple(finished.token_ids[:2]), finished.token_ids[2])]
    # the strip sits under the probabilities in their dock, on screen with them
    assert views.lens_split.widget(0) is window.panels.probabilities
    assert window.docks["probabilities"].widget() is views.lens_split and views.lens.isVisible()
    lens = views.lens.cells.lens
    info = window.host.engine.core.loaded.info
    assert len(lens.layers) == info.num_layers + 1
    assert lens.token_id == finished.token_ids[2]
    assert lens_answer_is_the_steps(views)
    assert "ms on the engine" in views.lens.cost.text()
    attention = views.attention.grid.attention
    assert len(attention.layers) == info.num_layers and attention.layers[0].heads == info.num_heads
    # the large map shows the chosen head (the last layer's first), the page map outlines its blocks
    assert views.attention.grid.chosen == (info.num_layers - 1, 0)
    assert window.panels.page_map.canvas.highlighted == attention.blocks_read(info.num_layers - 1)
    note = window.panels.page_map.highlight_note.text()
    assert note.startswith("outlined: the") and "the reply's own cached blocks" in note
    views.attention.grid.choose(0, 1)
    assert "layer 0, head 1" in views.attention.head_title.text()
    # hovering another token asks nothing; pinning the same token again asks nothing either
    window.controller.token_inspected.emit(finished.request_id, 4)
    window.controller.inspect_token(finished.request_id, 2)
    qtbot.wait(200)
    window.host._drain_calls()
    assert len(calls) == 1


def test_a_dense_models_expert_panel_says_it_has_none(make_window, qtbot):
    window = make_window()
    window.inside.docks["experts"].raise_()
    pinned_reply(qtbot, window)
    panel = window.inside.experts
    qtbot.waitUntil(lambda: "is not a mixture of experts" in panel.title.text(), timeout=TIMEOUT_MS)
    assert panel.maps.routes is None


def test_a_pasted_text_is_scored_and_one_past_the_context_refused_with_its_count(make_window, qtbot):
    window = make_window()
    panel = window.inside.score
    window.inside.docks["score"].raise_()
    panel.input.setPlainText("The sky is blue because of Rayleigh scattering.")
    panel.button.click()
    qtbot.waitUntil(lambda: panel.score is not None, timeout=TIMEOUT_MS)
    core = window.host.engine.core
    want = score_text(core, "The sky is blue because of Rayleigh scattering.")
    assert panel.score.perplexity == pytest.approx(want.perplexity, rel=1e-6)
    assert [t.logprob for t in panel.score.tokens] == pytest.approx(
        [t.logprob for t in want.tokens], abs=1e-6
    )
    assert "perplexity" in panel.summary.text() and "ms on the engine" in panel.summary.text()
    limit = core.limits.context_window
    long_text = "word " * (limit + 10)
    panel.input.setPlainText(long_text)
    panel.button.click()
    qtbot.waitUntil(lambda: "model's context holds" in panel.summary.text(), timeout=TIMEOUT_MS)
    assert f"holds {limit}" in panel.summary.text()
    assert panel.input.toPlainText() == long_text  # what the user pasted is kept
    panel.input.setPlainText("   ")
    panel.button.click()
    assert "no text to score" in panel.summary.text()


def test_a_control_vector_steers_the_pinned_tokens_distribution(make_window, qtbot, tmp_path):
    window = make_window()
    window.inside.docks["steering"].raise_()
    pinned_reply(qtbot, window)
    info = window.host.engine.core.loaded.info
    g = torch.Generator().manual_seed(0)
    vector = ControlVector(
        "test",
        (1,),
        (tuple((torch.randn(info.hidden_size, generator=g) * 3).tolist()),),
        "test",
    )
    path = tmp_path / "vector.gguf"
    write_control_vector(vector, path)
    panel = window.inside.steering
    window.inside.steer.load(str(path))
    qtbot.waitUntil(lambda: "KL(steered" in panel.status.text(), timeout=TIMEOUT_MS)
    assert panel.vector is not None and panel.vector.layers == (1,)
    assert "with the vector" in panel.result.text()
    panel.strength.setValue(0)
    qtbot.waitUntil(lambda: "×+0.0" in panel.status.text(), timeout=TIMEOUT_MS)
    assert "<b>0.000</b>" in panel.status.text()  # no strength, no move
    wide = ControlVector("wide", (1,), ((0.1,) * (info.hidden_size + 3),), "test")
    bad = tmp_path / "wide.gguf"
    write_control_vector(wide, bad)
    window.inside.steer.load(str(bad))
    qtbot.waitUntil(
        lambda: "wide, but this model's residual stream" in panel.status.text(), timeout=TIMEOUT_MS
    )
    assert panel.vector is not None and panel.vector.name == "vector"  # the good one stays loaded
