"""The first hour as a new user lives it: the Hub and the models on this machine in the File menu and
the toolbar with their shortcuts, the Controls dock's buttons whole at common screen sizes with Load
model never scrolled away, one action from a Hub file to a running model (a file already downloaded
used as it is), and from an empty HF cache to a reply through the Hub browser, against the local
test Hub server; the first-run layout on the screens people have (chat, token probabilities and
the page map in front at once)."""

from __future__ import annotations

import pytest
from app_windows import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS
from app_windows import TINY_REPO as TINY
from PySide6.QtCore import Qt
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QAbstractButton, QToolButton, QWidget
from test_model_browser import search

from app.models.browser import ON_DISK
from app.models.picker import process_estimate
from engine.config import SamplingParams
from engine.units import format_bytes

CTRL, SHIFT = Qt.KeyboardModifier.ControlModifier, Qt.KeyboardModifier.ShiftModifier


def menu_actions(window, title: str) -> dict[str, object]:
    menu = next(a.menu() for a in window.menuBar().actions() if a.text().replace("&", "") == title)
    return {a.text().replace("&", ""): a for a in menu.actions() if a.text()}


def test_the_ways_to_a_model_are_in_the_file_menu_and_the_toolbar(make_window, qtbot):
    window = make_window(start=False)
    actions = window.controls.model.actions
    file_menu = menu_actions(window, "File")
    assert file_menu["Open model file…"] is actions.open_file
    assert file_menu["Browse the Hugging Face Hub…"] is actions.hub
    assert file_menu["Models on this machine…"] is actions.on_this_machine
    assert "Open model folder…" in file_menu
    assert actions.open_file.shortcut() == QKeySequence("Ctrl+O")
    assert actions.hub.shortcut() == QKeySequence("Ctrl+Shift+O")
    toolbar = [b.defaultAction() for b in window.toolbar.findChildren(QToolButton) if b.defaultAction()]
    assert {actions.open_file, actions.hub, actions.on_this_machine} <= set(toolbar)
    assert window.toolbar.isVisible()

    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)  # shortcuts go to the active window
    qtbot.keyClick(window.chat.input, Qt.Key.Key_O, modifier=CTRL | SHIFT)  # the Hub, by its shortcut
    browser = window.controls.model._browser
    assert browser is not None
    assert browser.isVisible() and browser.tabs.currentIndex() == 0
    browser.close()
    actions.on_this_machine.trigger()
    assert browser.isVisible() and browser.tabs.currentWidget() is browser.cache
    browser.close()
    window.controls.model.wait_for_estimate()


@pytest.mark.parametrize("size", [(1366, 768), (1920, 1080), (960, 540)])
def test_no_button_of_the_controls_dock_is_clipped_and_load_is_never_scrolled_away(make_window, qtbot, size):
    window = make_window(start=False)
    window.resize(*size)
    qtbot.waitUntil(lambda: window.width() == size[0])
    dock = window.docks["controls"]
    assert dock.isVisible()
    controls = window.controls
    buttons = [b for b in controls.findChildren(QAbstractButton) if b.isVisibleTo(controls) and b.text()]
    assert buttons
    viewport = controls.scroll.viewport()
    for button in buttons:
        name = button.text()
        assert button.width() >= button.sizeHint().width(), f"{name!r} is squeezed to {button.width()} px"
        owner: QWidget = viewport if viewport.isAncestorOf(button) else controls
        left = button.mapTo(owner, button.rect().topLeft()).x()
        assert left >= 0 and left + button.width() <= owner.width(), f"{name!r} runs past the dock's edge"
    # the load bar sits above the scrolling part: scrolled to the bottom, Load model is still there
    load = controls.model.load_button
    assert not controls.scroll.isAncestorOf(load)
    controls.scroll.verticalScrollBar().setValue(controls.scroll.verticalScrollBar().maximum())
    assert not load.visibleRegion().isEmpty()
    controls.model.wait_for_estimate()


def load_through(qtbot, window, click) -> object:
    """Click (through `click`), then wait for the load it starts: the progress under Load model
    shows while it runs, the load notes once it is done."""
    picker = window.controls.model
    stages: list[str] = []
    window.host.model_loading.connect(lambda event: stages.append(event.stage))
    with qtbot.waitSignal(window.host.model_loaded, timeout=LOAD_TIMEOUT_MS) as loaded:
        click()
        qtbot.waitUntil(
            lambda: picker.load_progress.isVisibleTo(picker) or bool(stages), timeout=LOAD_TIMEOUT_MS
        )
    assert stages, "the load reported no progress"
    assert not picker.load_progress.isVisibleTo(picker)  # gone once loaded
    qtbot.waitUntil(lambda: picker.quantization.loaded.isVisibleTo(picker), timeout=LOAD_TIMEOUT_MS)
    assert picker.quantization.loaded.text().startswith("Loaded weights:")  # the load notes
    return loaded.args[0]


def test_from_an_empty_hf_cache_to_a_reply_through_the_hub_browser(make_window, qtbot, hub):
    """The scripted first hour: search, download with its byte bar, Use this model (one action
    loads it), then a chat reply from it."""
    window = make_window(start=False)
    picker = window.controls.model
    picker.actions.hub.trigger()
    browser = picker._browser
    search(qtbot, browser, "tiny-llama-chat")
    qtbot.waitUntil(lambda: browser.download_button.isEnabled(), timeout=30_000)
    assert browser.files_table.item(0, 2).text() == "–" and not browser.use_button.isEnabled()
    browser.download_button.click()
    qtbot.waitUntil(lambda: browser.use_button.isEnabled(), timeout=60_000)
    assert (
        browser.files_table.item(0, 2).text() == ON_DISK
        and "Use this model loads it" in browser.status.text()
    )
    assert browser.progress.value() == 1000

    event = load_through(qtbot, window, browser.use_button.click)
    assert event.info.source == TINY and not browser.isVisible()
    assert picker.choice().source == TINY and window.settings.model_choice().source == TINY
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as finished:
        window.controller.send("Hello from the Hub")
    reply = finished.args[0]
    assert reply.finish_reason == "length" and len(reply.token_ids) == 6
    assert window.chat.transcript.bubbles[-1].text == reply.text
    browser.worker.wait()


def test_a_file_already_downloaded_is_marked_and_used_without_downloading_again(make_window, qtbot, hub):
    window = make_window(start=False)
    picker = window.controls.model
    picker.actions.hub.trigger()
    browser = picker._browser
    search(qtbot, browser, "tiny-llama-chat")
    qtbot.waitUntil(lambda: browser.download_button.isEnabled(), timeout=30_000)
    browser.download_button.click()
    qtbot.waitUntil(lambda: browser.use_button.isEnabled(), timeout=60_000)
    browser.close()

    # a later session: the browser opens on a cache that already holds the file
    picker._browser = None
    browser.deleteLater()
    picker.actions.hub.trigger()
    browser = picker._browser
    search(qtbot, browser, "tiny-llama-chat")
    qtbot.waitUntil(
        lambda: browser.files_table.rowCount() == 1 and browser._files is not None, timeout=30_000
    )
    assert browser.files_table.item(0, 2).text() == ON_DISK
    assert not browser.download_button.isEnabled() and browser.download_button.text().endswith("is on disk")
    assert browser.use_button.isEnabled()
    weights_fetched = len(hub.ranges_for("model.safetensors"))
    load_through(qtbot, window, browser.use_button.click)
    assert len(hub.ranges_for("model.safetensors")) == weights_fetched  # nothing downloaded again
    browser.worker.wait()


def test_using_a_model_from_this_machine_loads_it(make_window, qtbot, hub):
    window = make_window(start=False)
    picker = window.controls.model
    picker.actions.hub.trigger()
    browser = picker._browser
    search(qtbot, browser, "tiny-llama-chat")
    qtbot.waitUntil(lambda: browser.download_button.isEnabled(), timeout=30_000)
    browser.download_button.click()
    qtbot.waitUntil(lambda: browser.use_button.isEnabled(), timeout=60_000)
    browser.close()
    picker.actions.on_this_machine.trigger()
    cache = browser.cache
    assert cache.table.rowCount() == 1 and cache.table.item(0, 0).text() == TINY
    cache.table.selectRow(0)
    event = load_through(qtbot, window, cache.use_button.click)
    assert event.info.source == TINY
    browser.worker.wait()


@pytest.mark.slow
def test_after_a_load_the_estimate_stands_beside_the_measurement(make_window, qtbot):
    """The packaged model through Load model: the estimate is read first, the load measured, and
    the picker shows both; the weights agree within 10%."""
    window = make_window(start=False)
    picker = window.controls.model
    picker.refresh_estimate()
    with qtbot.waitSignal(window.host.model_loaded, timeout=300_000) as loaded:
        picker.load_button.click()
    qtbot.waitUntil(picker.measured.isVisible, timeout=60_000)
    text = picker.measured.text()
    assert text.startswith("Estimated before loading → measured:"), text
    weights = loaded.args[0].info.weight_bytes
    estimated = picker._load_estimate[0]["weight_bytes"]
    assert abs(estimated - weights) <= 0.1 * weights
    assert f"weights {format_bytes(estimated)} → {format_bytes(weights)}" in text
    assert "\nprocess " in text and "(estimate " in text
    # the process: the measured runtime (this process's, or a first app load's here: kept in the
    # cache from another process, and another model's tokenizer) beside the weights; measured
    # -8% and -4% on this machine, held to 15% (tests/engine/test_fit_estimate.py holds 10%
    # where the runtime is this process's)
    expected = process_estimate(*picker._load_estimate)
    process = int(window.host.live.memory.column("process")[-1])
    assert abs(expected - process) <= 0.15 * process, f"process {expected} estimated, {process} measured"
    message = window.status.currentMessage()  # where the eye is after a load, too
    assert message.startswith(f"Loaded {loaded.args[0].info.name}. Estimated → measured: weights ")
    assert (
        f"weights {format_bytes(estimated)} → {format_bytes(weights)}" in message and "; process " in message
    )
    assert "Q4_1 x210 kept as " in picker.estimate.text()  # the per-type plan it counted


# The screens people have, in logical pixels: a laptop, a desktop, a 1440p screen at 100%, the
# same screen at 200% (1280x720 logical) and a 1920x1080 screen at 200% (960x540 logical).
SCREENS = [(1366, 768), (1920, 1080), (2560, 1440), (1280, 720), (960, 540)]
# the least each needs to be read: a message and its input, ~15 bars, a grid of pages; on the
# smallest screen the chat has less height (the graphs' row under it) and the column wraps
LEAST = {"chat": (420, 380), "probabilities": (250, 380), "page map": (250, 150)}
LEAST_AT = {(960, 540): {"chat": (380, 250), "probabilities": (230, 380), "page map": (250, 120)}}


def test_a_window_its_panels_grew_goes_back_within_the_screen(make_window, qtbot, monkeypatch):
    """Qt grows a window whose least size grows (a load's progress under the Load button) and
    never shrinks it: the window goes back to the screen's room, or the size it was placed at."""
    import app.window

    monkeypatch.setattr(app.window, "first_run_size", lambda available: (960, 540))
    window = make_window(start=False)
    qtbot.waitUntil(lambda: window.width() == 960)
    room = max(540, window.screen().availableGeometry().height())
    grows = window.controls.model.load_progress
    grows.show()
    grows.setMinimumHeight(room + 100)  # the Controls ask for more than the screen for a while
    qtbot.waitUntil(lambda: window.height() > room)
    grows.setMinimumHeight(0)
    grows.hide()
    qtbot.waitUntil(lambda: window.height() <= room)
    assert window.width() == 960


@pytest.mark.parametrize("screen", SCREENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_first_run_layout_shows_the_chat_the_probabilities_and_the_page_map_at_once(
    make_window, qtbot, monkeypatch, screen
):
    """A first launch on each screen: the window fits it, and the chat, the token probabilities
    and the page map are each in front (no tab hides them) and big enough to read."""
    import app.window

    monkeypatch.setattr(app.window, "first_run_size", lambda available: screen)
    window = make_window(start=False)
    qtbot.waitUntil(lambda: window.width() == screen[0])
    assert window.width() <= screen[0] and window.height() <= screen[1]
    least_size = window.minimumSizeHint().expandedTo(window.minimumSize())  # nothing runs off the screen
    assert least_size.width() <= screen[0] and least_size.height() <= screen[1], f"{least_size} on {screen}"
    docks = window.docks
    shown = {"chat": window.chat, "probabilities": docks["probabilities"], "page map": docks["page_map"]}
    least = LEAST_AT.get(screen, LEAST)
    for name, widget in shown.items():
        assert widget.isVisible(), f"the {name} is hidden"
        assert not widget.visibleRegion().isEmpty(), f"the {name} is behind another tab"
        width, height = least[name]
        assert widget.width() >= width and widget.height() >= height, (
            f"the {name} is {widget.width()}x{widget.height()} on {screen}"
        )
    # the Controls dock has room for its fields at every size
    controls = window.controls
    for button in controls.findChildren(QAbstractButton):
        if button.isVisibleTo(controls) and button.text():
            assert button.width() >= button.sizeHint().width(), f"{button.text()!r} squeezed on {screen}"
    window.controls.model.wait_for_estimate()
