"""The scripted run (`kvscope --prompt ... --screenshot ... --quit-after-reply`) on the tiny model."""

from __future__ import annotations

import pytest
from app_windows import REPLY_TIMEOUT_MS
from PySide6.QtGui import QImage

from app.main import model_choice, parse_args
from app.scripted import ScriptedRun, most_uncertain_token
from app.settings import ModelChoice
from engine.config import SamplingParams


def test_scripted_run_replies_screenshots_and_finishes_with_0(
    make_window, qtbot, tiny_loaded, test_config, tmp_path
):
    window = make_window(start=False)
    window.controls.sampling.set_params(
        SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, snapshot_top_n=5)
    )
    shot = tmp_path / "shots" / "window.png"
    run = ScriptedRun(window, "Hello", shot, quit_after_reply=True, timeout_s=120)
    window.start_engine(test_config, loaded=tiny_loaded)
    qtbot.waitUntil(lambda: run.finished, timeout=REPLY_TIMEOUT_MS)
    assert run.exit_code == 0 and run.reply
    image = QImage(str(shot))
    assert not image.isNull() and (image.width(), image.height()) == (window.width(), window.height())
    assert not window.isVisible()  # --quit-after-reply closed the window (and stopped the engine)
    assert not window.host.threads_alive()
    # The probability panel shows a token of that reply: the most uncertain one.
    view = window.host.live.requests[run.request_id]
    assert window.controller.pinning.pinned == (run.request_id, most_uncertain_token(view.tokens))


def test_scripted_run_reports_a_load_failure_with_exit_code_1(make_window, qtbot, tmp_path, capsys):
    window = make_window(start=False)
    run = ScriptedRun(window, "Hello", tmp_path / "x.png", quit_after_reply=True, timeout_s=120)
    window.load_model(ModelChoice(source=str(tmp_path / "missing-model")))
    qtbot.waitUntil(lambda: run.finished, timeout=REPLY_TIMEOUT_MS)
    assert run.exit_code == 1
    assert "kvscope: the model failed to load" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_scripted_runs_start_from_the_default_model_not_the_last_one():
    saved = ModelChoice(source="/models/other", dtype="bfloat16", block_size=8)
    assert model_choice(parse_args(["--prompt", "hi"]), saved) == ModelChoice()
    assert model_choice(parse_args([]), saved) == saved  # interactive: the last model
    assert model_choice(parse_args(["--block-size", "32"]), saved).block_size == 32


def test_the_app_takes_a_repo_id_with_gguf_file():
    repo = "someone/tiny-llama-GGUF"
    assert parse_args(["--model", repo, "--gguf-file", "tiny-Q4_1.gguf"]).model == f"{repo}:tiny-Q4_1.gguf"
    with pytest.raises(SystemExit):
        parse_args(["--gguf-file", "tiny-Q4_1.gguf"])  # no repo to take it from
