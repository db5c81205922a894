"""The what-if in the window: with the what-if view on, a selected token of a reply is recomputed
exactly on the engine thread (the step's own logits, kept for the token, through the sampler's
stages under the controls' settings) and the probability panel shows that, labelled with the
logits it ran on; the same settings give back the recorded token bit for bit."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from test_app_chat import send_and_wait, use_params

from engine.core.what_if import HOW, WhatIf
from engine.inside import KEPT

TIMEOUT_MS = 60_000


def test_a_selected_token_is_recomputed_on_the_engine_under_new_settings(make_window, qtbot, monkeypatch):
    window = make_window()
    recorded = use_params(window, temperature=0.9, top_k=40, max_new_tokens=4, seed=3)
    finished = send_and_wait(qtbot, window, "Name a colour.")
    threads = []
    original = WhatIf._logits_for
    monkeypatch.setattr(
        WhatIf,
        "_logits_for",
        lambda *args: threads.append(threading.current_thread().name) or original(*args),
    )
    panel = window.panels.probabilities
    window.controller.inspect_token(finished.request_id, 2)
    window.controls.sampling.what_if.setChecked(True)
    controls = window.controls.sampling
    controls.temperature.setValue(0.4)  # as the user edits them
    controls.top_k.setValue(5)
    other = replace(recorded, temperature=0.4, top_k=5)
    assert controls.params() == other
    qtbot.waitUntil(
        lambda: HOW[KEPT] in panel.banner.text() and "top-k 5" in panel.banner.text(), timeout=TIMEOUT_MS
    )
    assert set(threads) == {"kvscope-engine"}

    # What the panel shows is the engine's recomputation under the new settings.
    token = window.host.live.token(finished.request_id, 2)
    request = window.host.request(finished.request_id)
    outputs = list(finished.token_ids[:2])
    answer = WhatIf().recompute(window.host.engine.core, request, outputs, token.snapshot, other)
    assert answer.logits_from == KEPT
    expected = answer.snapshot
    assert (
        [s.name for s in panel.stages] == [s.name for s in expected.stages] == ["raw", "temperature", "top_k"]
    )
    assert [row.prob for row in panel.rows] == pytest.approx(list(expected.stages[-1].probs), abs=1e-6)
    assert panel.stages[-1].kept_count == 5

    # Back to the token's own settings: the recomputation is the recorded snapshot.
    controls.temperature.setValue(0.9)
    controls.top_k.setValue(40)
    qtbot.waitUntil(
        lambda: "top-k 40" in panel.banner.text() and HOW[KEPT] in panel.banner.text(), timeout=TIMEOUT_MS
    )
    assert [row.prob for row in panel.rows] == list(token.snapshot.stages[-1].probs)  # bit for bit
    assert set(threads) == {"kvscope-engine", "MainThread"}  # the app's on the engine, the test's own here
