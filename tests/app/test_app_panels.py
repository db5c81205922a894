"""Panel refresh order: plots take turns, nothing is missed, hidden plots catch up now and then."""

from __future__ import annotations

from dataclasses import fields

from app.panels import HIDDEN_EVERY_FRAMES, PLOT_INTERVAL_S, PLOTS, Panels


class FakePanel:
    def __init__(self, visible: bool = True):
        self.visible = visible
        self.calls: list[set[str]] = []

    def isVisible(self) -> bool:  # noqa: N802 - Qt's name
        return self.visible

    def refresh(self, dirty: set[str]) -> None:
        self.calls.append(set(dirty))


def make_panels(**visibility) -> Panels:
    names = [f.name for f in fields(Panels) if not f.name.startswith("_")]
    return Panels(**{name: FakePanel(visibility.get(name, True)) for name in names})


def test_every_non_plot_panel_refreshes_every_frame_even_when_hidden():
    panels = make_panels(speculation=False)
    for keys in ({"tokens"}, set(), {"kv"}):
        panels.refresh(keys)
    for name, panel in panels.named():
        if name not in PLOTS:
            assert panel.calls == [{"tokens"}, set(), {"kv"}], name


def test_visible_plots_take_turns_and_receive_every_key_they_missed():
    panels = make_panels(roofline=False, step_timeline=False)  # visible plots: memory, latency
    for t, keys in enumerate(({"memory"}, {"latency"}, {"steps"}, set())):
        panels.refresh(keys, now=t * PLOT_INTERVAL_S)
    # One plot per frame, in turn; each turn brings every key since that plot's last turn.
    assert panels.memory.calls == [{"memory"}, {"latency", "steps"}]
    assert panels.latency.calls == [{"memory", "latency"}, {"steps"}]


def test_a_visible_plot_redraws_at_most_once_per_interval_and_misses_no_key():
    panels = make_panels(roofline=False, step_timeline=False, memory=False)  # latency only
    frame_s = PLOT_INTERVAL_S / 5
    for i in range(11):
        panels.refresh({f"k{i}"}, now=i * frame_s)
    assert len(panels.latency.calls) == 3  # at 0, 1 and 2 intervals
    assert set().union(*panels.latency.calls) == {f"k{i}" for i in range(11)}
    assert panels.probabilities.calls == [{f"k{i}"} for i in range(11)]  # not a plot: every frame


def test_hidden_plots_catch_up_every_few_frames():
    panels = make_panels(roofline=False)
    panels.refresh({"steps"})
    for _ in range(HIDDEN_EVERY_FRAMES - 1):
        panels.refresh(set())
    assert panels.roofline.calls == [{"steps"}]  # once, with the key from the first frame


def test_refresh_all_draws_every_panel_now():
    panels = make_panels(roofline=False)
    panels.refresh({"latency"})
    panels.refresh_all({"model"})
    for name, panel in panels.named():
        assert panel.calls[-1] >= {"model"}, name
    assert panels.roofline.calls[-1] == {"latency", "model"}  # every key it had not seen
