"""The inside-the-model panels draw the engine's answers as given (hand-built here): the lens
strip's ranks, colours and first lead; the attention grid's maps laid out by KV block, a sliding
window's positions greyed, the chosen head's tokens and the blocks its layer read; the expert maps'
load and routes; the scoring view's surprise; the steering view's two distributions."""

from __future__ import annotations

import numpy as np
import pytest

from engine.inside import (
    REPLAY_LOGITS,
    AttentionMap,
    Candidates,
    ControlVector,
    ExpertRoutes,
    LayerAttentionMap,
    LensLayer,
    LogitLens,
    ScoredToken,
    Steered,
    TextScore,
    TokenRoute,
)
from widgets.attention_view import BEFORE_WINDOW, UNUSED_SLOT, AttentionPanel, head_map
from widgets.expert_view import ExpertPanel, describe_token
from widgets.heat import LUT, heat_rgb, log_scale
from widgets.lens_strip import LensStrip
from widgets.score_view import ScorePanel
from widgets.steering_view import SteeringPanel


def candidates(n: int = 3, first: int = 10) -> Candidates:
    probs = tuple(float(p) for p in np.linspace(0.5, 0.1, n))
    return Candidates(tuple(range(first, first + n)), tuple(f" w{i}" for i in range(n)), probs)


def lens(ranks: list[int]) -> LogitLens:
    layers = tuple(LensLayer(stage, rank, 1.0 / rank, candidates(), 1.0) for stage, rank in enumerate(ranks))
    first = next((i for i, r in enumerate(ranks) if r == 1), None)
    return LogitLens(11, " blue", layers, first, 0.0)


def test_the_lens_strip_shows_each_stages_rank_and_where_the_token_first_leads(qtbot):
    strip = LensStrip()
    qtbot.addWidget(strip)
    strip.resize(400, 120)
    strip.show()
    strip.set_lens(lens([900, 40, 3, 1, 2, 1]))
    assert strip.cells.lens.first_lead == 3
    assert "first leads after layer 2" in strip.title.text()
    assert "the step's own logits, to the bit" in strip.title.text()
    assert "after layer 4" in strip.detail.text()  # the last stage, shown first
    strip.cells.stage_clicked.emit(0)
    assert "after the embedding" in strip.detail.text()
    strip.repaint()
    stage = strip.cells.stage_at(1.0)
    assert stage == 0
    strip.set_lens(LogitLens(11, "<b>", lens([5, 4]).layers, None, 3e-7))
    assert "never the top candidate" in strip.title.text() and "&lt;b&gt;" in strip.title.text()
    assert "within 3e-07 of the step's own logits" in strip.title.text()
    strip.set_lens(LogitLens(11, " blue", lens([5, 1]).layers, 1, 0.0, REPLAY_LOGITS))
    assert "the replayed step's logits, to the bit" in strip.title.text()
    strip.show_message("no lens for this model: why")
    assert strip.cells.lens is None and "why" in strip.title.text()


def attention_map(positions: int = 11, block_size: int = 4, window: int | None = None) -> AttentionMap:
    layers = []
    for layer, slide in enumerate((None, window)):
        start = 0 if slide is None else max(0, positions - slide)
        n = positions - start
        weights = np.arange(1, n + 1, dtype=float)
        probs = tuple(tuple(float(w) for w in weights / weights.sum()) for _ in range(2))
        layers.append(LayerAttentionMap(layer, start, slide, None, False, probs))
    blocks = tuple(range(7, 7 + -(-positions // block_size)))
    texts = tuple(f"t{i}" for i in range(positions))
    return AttentionMap(
        positions - 1, tuple(range(positions)), texts, block_size, blocks, tuple(layers), "kvk"
    )


def test_a_heads_map_is_its_weights_by_block_and_slot_with_the_window_greyed():
    att = attention_map(positions=11, block_size=4, window=5)
    full = head_map(att, 0, 0)
    assert full.shape == (3, 4, 3)
    assert tuple(full[2, 2]) == tuple(LUT[255])  # the last position, the largest weight
    assert tuple(full[2, 3]) == UNUSED_SLOT  # past the query in its block
    sliding = head_map(att, 1, 0)
    assert tuple(sliding[0, 0]) == BEFORE_WINDOW and tuple(sliding[1, 1]) == BEFORE_WINDOW  # positions 0-5
    assert tuple(sliding[1, 2]) == tuple(heat_rgb(np.asarray(1 / 5)))  # position 6: 1/5 of the largest
    assert att.blocks_read(0) == (7, 8, 9) and att.blocks_read(1) == (8, 9)


def test_the_attention_panel_shows_the_chosen_head_and_the_blocks_its_layer_read(qtbot):
    panel = AttentionPanel()
    qtbot.addWidget(panel)
    panel.resize(500, 600)
    panel.show()
    outlined = []
    panel.blocks_read.connect(lambda blocks, note: outlined.append((blocks, note)))
    att = attention_map(window=5)
    panel.set_attention(att, " drawn")
    assert panel.grid.chosen == (1, 0)
    assert outlined[-1][0] == (8, 9) and "window of 5" in outlined[-1][1]
    assert "layer 1, head 0" in panel.head_title.text()
    assert panel.tokens.values[:6] == [None] * 6  # before the window
    assert panel.tokens.values[-1] == pytest.approx(1.0)
    assert panel.tokens.marked == frozenset({10})
    panel.grid.choose(0, 1)
    assert outlined[-1][0] == (7, 8, 9)
    panel.repaint()
    assert panel.grid.cell_at(30, 16) == (0, 0)
    panel.show_message("not available on a remote engine (the logit lens and attention of a token)")
    assert panel.grid.attention is None and "remote engine" in panel.title.text()


def test_a_sinks_share_is_said():
    layer = LayerAttentionMap(0, 0, None, None, True, ((0.5, 0.3),))
    assert layer.sink_mass(0) == pytest.approx(0.2)
    assert LayerAttentionMap(0, 0, None, None, False, ((0.5, 0.5),)).sink_mass(0) == 0.0


def test_the_expert_panel_draws_load_and_routes(qtbot):
    panel = ExpertPanel()
    qtbot.addWidget(panel)
    panel.resize(500, 400)
    panel.show()
    routes = ExpertRoutes(
        4,
        2,
        (0, 1),
        (5, 6, 7),
        ("a", "b", "c"),
        2,
        tuple(
            (TokenRoute((p % 4, (p + 1) % 4), (0.7, 0.3)), TokenRoute((3, 0), (0.6, 0.4))) for p in range(3)
        ),
        ((0, 0, 1, 1), (1, 0, 0, 1)),
        0.01,
    )
    panel.set_routes(routes, 2)
    assert "4 experts, top 2" in panel.title.text() and "1 in the reply" in panel.title.text()
    assert "layer 0: expert 2 (0.70), expert 3 (0.30)" in panel.detail.text()
    assert "reply token 0" in describe_token(routes, 2) and "prompt" in describe_token(routes, 0)
    panel.repaint()
    panel.show_message("qwen2 is not a mixture of experts: it has no expert routes to show")
    assert panel.maps.routes is None


def test_the_score_panel_colours_surprise_and_says_the_perplexity(qtbot):
    panel = ScorePanel()
    qtbot.addWidget(panel)
    panel.show()
    asked = []
    panel.score_requested.connect(asked.append)
    panel.input.setPlainText("hello world")
    panel.button.click()
    assert asked == ["hello world"] and not panel.button.isEnabled()
    tokens = (
        ScoredToken(1, "hello", None, None, None),
        ScoredToken(2, " world", -2.0, 3, candidates(), (-1.0, -1.5, -2.0)),
    )
    panel.show_score(TextScore(tokens, -2.0, 1, 0.02))
    assert panel.button.isEnabled()
    assert "perplexity <b>7.39</b>" in panel.summary.text()
    assert panel.tokens.values[0] is None and panel.tokens.values[1] == pytest.approx(2.0 / np.log(2) / 12.0)
    assert "rank 3" in panel.tokens.tips[1]
    panel.show_error("The text is 3000 tokens but the model's context holds 2048: shorten it to score it.")
    assert "model's context holds 2048" in panel.summary.text()
    assert panel.input.toPlainText() == "hello world"


def test_the_steering_panel_asks_on_each_move_and_shows_both_distributions(qtbot):
    panel = SteeringPanel()
    qtbot.addWidget(panel)
    panel.show()
    asked = []
    panel.steer_requested.connect(lambda layer, strength: asked.append((layer, strength)))
    assert not panel.strength.isEnabled()
    vector = ControlVector("calm", (1, 2, 3), ((0.0,) * 4,) * 3, "calm.gguf", "llama")
    panel.set_vector(vector)
    assert asked[-1] == (2, 1.0)  # a middle layer, strength 1
    panel.strength.setValue(-25)
    assert asked[-1] == (2, -2.5)
    panel.layer.setCurrentIndex(0)
    assert asked[-1] == (None, -2.5)  # every layer the vector has
    steered = Steered((1, 2, 3), -2.5, candidates(first=10), candidates(first=11), 0.25, 0.05)
    panel.show_steered(steered, " blue")
    assert "KL(steered ‖ plain) = <b>0.250</b>" in panel.status.text()
    assert "new" in panel.result.text()  # a candidate the vector brought in
    contrasts = []
    panel.contrast_requested.connect(lambda a, b: contrasts.append((a, b)))
    panel.contrast_button.click()
    assert contrasts == [] and "Type both prompts" in panel.status.text()


def test_the_heat_ramp():
    assert tuple(heat_rgb(np.asarray(0.0))) == tuple(LUT[0])
    assert log_scale(1.0) == pytest.approx(1.0) and log_scale(1e-7) == 0.0 and 0 < log_scale(1e-3) < 1
