"""The sampling controls cover every engine setting and produce valid SamplingParams."""

from __future__ import annotations

import pytest

from app.sampling_controls import (
    EXPLANATIONS,
    SamplingControls,
    format_stop_strings,
    parse_stop_strings,
    sampling_field_names,
)
from engine.config import SamplingParams


def test_every_sampling_field_has_a_control_and_an_explanation():
    assert set(EXPLANATIONS) == sampling_field_names()
    assert all(label and explanation for label, explanation in EXPLANATIONS.values())


@pytest.mark.parametrize(
    "text, stops",
    [
        ("", ()),
        ("###", ("###",)),
        ("### | User:", ("###", "User:")),
        ("\\n\\n|a\\|b|back\\\\slash", ("\n\n", "a|b", "back\\slash")),
    ],
)
def test_stop_strings_parse_and_format_round_trip(text, stops):
    assert parse_stop_strings(text) == stops
    assert parse_stop_strings(format_stop_strings(stops)) == stops


def test_edits_emit_new_params(qtbot):
    controls = SamplingControls(SamplingParams())
    qtbot.addWidget(controls)
    with qtbot.waitSignal(controls.changed) as blocker:
        controls.temperature.setValue(0.35)
    assert blocker.args[0].temperature == pytest.approx(0.35)
    controls.seed_fixed.setChecked(True)
    controls.seed.setValue(42)
    controls.stop.setText("END | \\n")
    controls.top_k.setValue(7)
    p = controls.params()
    assert (p.seed, p.stop, p.top_k) == (42, ("END", "\n"), 7)
    controls.seed_fixed.setChecked(False)
    assert controls.params().seed is None and not controls.seed.isEnabled()


def test_set_params_shows_values_without_emitting(qtbot):
    controls = SamplingControls(SamplingParams())
    qtbot.addWidget(controls)
    wanted = SamplingParams(
        temperature=0.0, top_p=0.5, min_p=0.1, repetition_penalty=1.3, max_new_tokens=9, ignore_eos=True
    )
    with qtbot.assertNotEmitted(controls.changed):
        controls.set_params(wanted)
    assert controls.params() == wanted
    assert controls.top_p.value() == pytest.approx(0.5) and controls.ignore_eos.isChecked()


def test_what_if_toggle_passes_settings_and_none(qtbot):
    controls = SamplingControls(SamplingParams(temperature=1.0))
    qtbot.addWidget(controls)
    with qtbot.waitSignal(controls.what_if_changed) as on:
        controls.what_if.setChecked(True)
    assert on.args[0] == controls.params()
    with qtbot.waitSignal(controls.what_if_changed) as edited:
        controls.top_p.setValue(0.5)
    assert edited.args[0].top_p == pytest.approx(0.5)
    with qtbot.waitSignal(controls.what_if_changed) as off:
        controls.what_if.setChecked(False)
    assert off.args[0] is None


def test_group_settings_and_invalid_combinations_are_explained_not_fixed(qtbot):
    controls = SamplingControls(SamplingParams(temperature=0.7))
    qtbot.addWidget(controls)
    assert not controls.length_penalty.isEnabled() and not controls.early_stopping.isEnabled()
    controls.num_beams.setValue(3)  # beam search does not sample: temperature 0.7 is refused
    assert not controls.error.isHidden() and "set temperature 0" in controls.error.text()
    assert controls.params().num_beams == 1 and controls.temperature.value() == pytest.approx(0.7)
    assert controls.length_penalty.isEnabled() and controls.early_stopping.isEnabled()
    with qtbot.waitSignal(controls.changed) as valid:
        controls.temperature.setValue(0.0)
    assert valid.args[0].num_beams == 3 and controls.error.isHidden()
    controls.early_stopping.setCurrentIndex(2)
    controls.length_penalty.setValue(-0.5)
    assert (controls.params().early_stopping, controls.params().length_penalty) == ("never", -0.5)

    controls.num_beams.setValue(1)
    controls.n.setValue(4)  # greedy samples would all be equal: refused at temperature 0
    assert "set a temperature above 0" in controls.error.text() and controls.params().n == 1
    controls.temperature.setValue(0.9)
    assert controls.params().n == 4

    wanted = SamplingParams(temperature=0.0, num_beams=2, early_stopping=True, length_penalty=2.0)
    controls.set_params(wanted)
    assert controls.params() == wanted and controls.early_stopping.currentIndex() == 1
