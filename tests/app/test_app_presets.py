"""Sampling presets (built-in ones with their reasons; save, load, delete), and logit bias and
banned tokens typed as text, resolved by the engine's tokenizer and shown as tokens."""

from __future__ import annotations

import json

import pytest
from app_windows import REPLY_TIMEOUT_MS

from app.sampling_controls import SamplingControls
from app.sampling_presets import BUILTIN_PRESETS, CUSTOM_LABEL, SAMPLER_FIELDS, PresetBar, PresetStore
from app.settings import AppSettings
from app.token_entries import EntryError, parse_banned, parse_bias
from engine.config import SamplingParams


def test_builtin_presets_are_valid_and_each_says_why():
    assert len(BUILTIN_PRESETS) >= 5
    for preset in BUILTIN_PRESETS:
        assert preset.reason.endswith(".") and len(preset.reason) < 120  # one line
        assert set(preset.values) == set(SAMPLER_FIELDS)
        assert preset.token_texts == {"logit_bias": "", "banned": ""}
        preset.apply_to(SamplingParams())  # valid
    names = [p.name for p in BUILTIN_PRESETS]
    assert len(set(names)) == len(names)


def test_a_preset_sets_the_sampler_and_leaves_length_seed_and_stops(qtbot, tmp_path):
    store = PresetStore(AppSettings(tmp_path / "s.ini"))
    controls = SamplingControls(SamplingParams(max_new_tokens=77, seed=5, stop=("END",), temperature=0.3))
    qtbot.addWidget(controls)
    bar = PresetBar(store, controls)
    qtbot.addWidget(bar)
    assert bar.combo.currentText() == CUSTOM_LABEL
    with qtbot.waitSignal(controls.changed, raising=False, timeout=100):
        assert bar.apply("Creative writing")
    p = controls.params()
    assert (p.temperature, p.min_p, p.xtc_probability, p.dry_multiplier) == (1.0, 0.05, 0.5, 0.8)
    assert (p.max_new_tokens, p.seed, p.stop) == (77, 5, ("END",))
    assert bar.combo.currentText() == "Creative writing" and "XTC" in bar.reason.text()
    assert not bar.delete_button.isEnabled()  # built-ins stay


def test_save_load_and_delete_a_preset_of_ones_own(qtbot, tmp_path):
    settings = AppSettings(tmp_path / "s.ini")
    controls = SamplingControls(SamplingParams(temperature=0.42, top_k=13, typical_p=0.8, snapshot_top_n=5))
    qtbot.addWidget(controls)
    bar = PresetBar(PresetStore(settings), controls)
    qtbot.addWidget(bar)
    controls.set_params(controls.params(), {"logit_bias": "#7=2", "banned": "#9"})
    assert bar.save_as("My careful one") is not None
    assert bar.combo.currentText() == "My careful one  (yours)"
    assert bar.save_as("Code") is None and "built-in" in bar.reason.text()

    # Another session: the preset is in the settings file, with the typed entries.
    controls2 = SamplingControls(SamplingParams(snapshot_top_n=20))
    qtbot.addWidget(controls2)
    bar2 = PresetBar(PresetStore(AppSettings(tmp_path / "s.ini")), controls2)
    qtbot.addWidget(bar2)
    assert bar2.apply("My careful one")
    p = controls2.params()
    assert (p.temperature, p.top_k, p.typical_p, p.snapshot_top_n) == (0.42, 13, 0.8, 20)
    assert controls2.token_texts() == {"logit_bias": "#7=2", "banned": "#9"}
    assert p.logit_bias == ((7, 2.0),) and p.banned_token_ids == (9,)  # ids apply without a model
    assert bar2.delete_button.isEnabled()
    bar2.delete_button.click()
    assert PresetStore(settings).get("My careful one") is None and bar2.combo.currentText() == CUSTOM_LABEL


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Paris=5", [("Paris", None, 5.0)]),
        ('" Paris"=-2.5 | #42=100', [(" Paris", None, -2.5), (None, 42, 100.0)]),
        ('"a|b=c"=1', [("a|b=c", None, 1.0)]),
        ("", []),
    ],
)
def test_bias_entries_parse(text, expected):
    assert [(e.text, e.token_id, e.bias) for e in parse_bias(text)] == expected


@pytest.mark.parametrize(
    "text, says",
    [("Paris", "TEXT=AMOUNT"), ("x=lots", "not a number"), ("x=500", "-100 and 100"), ('"open=1', "quote")],
)
def test_bad_bias_entries_say_why(text, says):
    with pytest.raises(EntryError, match=says):
        parse_bias(text)


def test_banned_entries_parse():
    assert [(e.text, e.token_id) for e in parse_banned('sorry | " As an AI" | #12')] == [
        ("sorry", None),
        (" As an AI", None),
        (None, 12),
    ]


def test_typed_entries_become_the_models_tokens_and_a_banned_token_is_never_drawn(
    make_window, qtbot, default_tokenizer
):
    window = make_window()
    controls = window.controls.sampling
    controls.set_params(SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=6, snapshot_top_n=8))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send("Say something")
    first = finished.args[0].token_ids[0]
    word = default_tokenizer.decode([first])

    controls.tokens.banned.setText(json.dumps(word))  # quoted: keeps spaces and newlines
    controls.tokens.banned.textEdited.emit(controls.tokens.banned.text())
    controls.tokens.bias.setText('" Paris"=3')
    controls.tokens.bias.textEdited.emit(controls.tokens.bias.text())
    qtbot.waitUntil(
        lambda: bool(controls.params().banned_token_ids and controls.params().logit_bias),
        timeout=REPLY_TIMEOUT_MS,
    )
    paris = tuple(default_tokenizer(" Paris", add_special_tokens=False)["input_ids"])
    assert controls.params().logit_bias == tuple((t, 3.0) for t in paris)
    assert first in controls.params().banned_token_ids
    shown = controls.tokens.bias_tokens.text()
    assert all(f"#{t}" in shown for t in paris) and "+3" in shown  # shown as tokens
    assert f"#{first}" in controls.tokens.banned_tokens.text()

    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.regenerate()
    assert first not in finished.args[0].token_ids
    token = window.host.live.token(finished.args[0].request_id, 0)
    assert [s.name for s in token.snapshot.stages] == ["raw", "logit_bias", "banned_tokens"]
    assert window.settings.token_texts()["logit_bias"] == '" Paris"=3'  # kept as typed


def test_an_entry_the_model_cannot_tokenize_is_said_under_its_field(make_window, qtbot):
    window = make_window()
    tokens = window.controls.sampling.tokens
    tokens.banned.setText("#99999999")
    tokens.resolve_now()
    qtbot.waitUntil(lambda: "the model has" in tokens.banned_tokens.text(), timeout=REPLY_TIMEOUT_MS)
    assert window.controls.sampling.params().banned_token_ids == ()
    tokens.bias.setText("nonsense")
    tokens.resolve_now()
    assert "TEXT=AMOUNT" in tokens.bias_tokens.text()
