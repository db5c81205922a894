"""What each view of the model's inside costs, and how each looks: `python -m tools.inside_views`.

Costs (`--json` for one object): on a model (the packaged one by default) a reply is generated,
then, interleaved over its tokens and rounds, each view is computed on the engine (the logit lens
and the attention grid of a token, one replay; a what-if on the kept logits and recomputed; scoring
a text; steering; expert routes on a mixture of experts) and drawn by its panel offscreen, each
beside the cost of one decode step measured in the same rounds (so a loaded machine shows as
ratios). Goal: the lens and the attention grid of a token in under 300 ms on the packaged model.

Screenshots (`--screenshots DIR`): the window on the same model answers a prompt, a token is
pinned, and every panel (lens, attention, experts, score, steering, the page map with its outline)
is saved as DIR/<panel>.png, and the whole window as DIR/window.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT = "Why is the sky blue? Answer in three sentences."
SCORE_TEXT = (
    "The sky looks blue because air molecules scatter short wavelengths of sunlight far more than "
    "long ones, so blue light reaches our eyes from every direction of the sky."
)
POSITIVE, NEGATIVE = (
    "I love this, it is wonderful and makes me happy.",
    "I hate this, it is awful and makes me sad.",
)


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000.0, 1)


def measure(source: str, quantization: str, tokens: int, rounds: int) -> dict[str, Any]:
    from engine.config import EngineConfig, ModelSpec, SamplingParams
    from engine.core.experts import expert_routes
    from engine.core.inside_token import inside_token
    from engine.core.kept_logits import KeptLogits
    from engine.core.llm_engine import LLMEngine
    from engine.core.scoring import score_text
    from engine.core.steering import contrast_vector, steer
    from engine.core.what_if import WhatIf
    from engine.errors import InspectionError
    from engine.model.loading import load_model
    from engine.request import Request

    loaded = load_model(ModelSpec(source, quantization=quantization))
    core = LLMEngine(loaded, EngineConfig(model=ModelSpec(source, quantization=quantization)))
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True, snapshot_top_n=10)
    request = Request.chat(PROMPT, sampling=params)
    (end,) = core.run([request])
    reply = list(end.token_ids)
    step = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    vector = contrast_vector(core, POSITIVE, NEGATIVE)
    middle = vector.layers[len(vector.layers) // 2]
    is_moe = True
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "decode_step",
            "lens_and_attention",
            "what_if_kept",
            "what_if_recomputed",
            "score",
            "steer",
            "experts",
        )
    }
    picks = [len(reply) // 4, len(reply) // 2, len(reply) - 1]
    for _ in range(rounds):
        for index in picks:
            started = time.perf_counter()
            (one,) = core.run([Request.chat(PROMPT, sampling=step)])
            times["decode_step"].append(
                (one.stats.itl_s[0]) if one.stats.itl_s else time.perf_counter() - started
            )
            inside = inside_token(core, request, reply[:index], reply[index])
            times["lens_and_attention"].append(inside.seconds)
            snapshot = _snapshot(core, request, reply, index)
            what_if = WhatIf()
            started = time.perf_counter()
            what_if.recompute(core, request, reply[:index], snapshot, params)
            times["what_if_kept"].append(time.perf_counter() - started)
            kept, core.kept_logits = core.kept_logits, KeptLogits(0)
            started = time.perf_counter()
            WhatIf().recompute(core, request, reply[:index], snapshot, params)
            times["what_if_recomputed"].append(time.perf_counter() - started)
            core.kept_logits = kept
            times["score"].append(score_text(core, SCORE_TEXT).seconds)
            times["steer"].append(steer(core, request, reply[:index], vector, middle, 4.0).seconds)
            if is_moe:
                try:
                    times["experts"].append(expert_routes(core, request, reply).seconds)
                except InspectionError:
                    is_moe = False
    draw = draw_costs(core, request, reply, picks[1])
    return {
        "model": loaded.info.name,
        "quantization": loaded.info.quantization,
        "context_tokens": len(core.prompt_ids(request)) + len(reply),
        "rounds": rounds,
        "engine_ms": {k: _ms(v) for k, v in times.items() if v},
        "engine_ms_over_decode_step": {
            k: round(statistics.median(v) / statistics.median(times["decode_step"]), 2)
            for k, v in times.items()
            if v and k != "decode_step"
        },
        "draw_ms": draw,
        "goal": "lens_and_attention + its drawing < 300 ms on the packaged model",
        "notes": "experts: a dense model has none" if not is_moe else "",
    }


def _snapshot(core, request, reply, index):
    """The recorded snapshot of reply token `index`, as the what-if is handed it (from the logits
    the engine kept for it)."""
    from engine.sampling.sampler import Sampler

    context = [*core.prompt_ids(request), *reply[:index]]
    logits = core.kept_logits.get(context)
    sampler = Sampler(request.sampling, decode_token=core.text.text)
    prompt = core.prompt_ids(request)
    return sampler.result_for(logits, prompt, reply[:index], reply[index]).snapshot


def draw_costs(core, request, reply, index) -> dict[str, float]:
    """Each panel fed the engine's answer and painted offscreen (median of 5)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtWidgets import QApplication

    from engine.core.inside_token import inside_token
    from engine.core.scoring import score_text
    from widgets.attention_view import AttentionPanel
    from widgets.lens_strip import LensStrip
    from widgets.score_view import ScorePanel

    app = QApplication.instance() or QApplication([])
    inside = inside_token(core, request, reply[:index], reply[index])
    score = score_text(core, SCORE_TEXT)
    lens, attention, scoring = LensStrip(), AttentionPanel(), ScorePanel()
    for panel in (lens, attention, scoring):
        panel.resize(440, 700)
        panel.show()
    out: dict[str, list[float]] = {"lens": [], "attention": [], "score": []}
    for _ in range(5):
        for name, draw, widget in (
            ("lens", lambda: lens.set_lens(inside.lens), lens),
            ("attention", lambda: attention.set_attention(inside.attention, "x"), attention),
            ("score", lambda: scoring.show_score(score), scoring),
        ):
            started = time.perf_counter()
            draw()
            widget.grab()  # the paint, done now
            out[name].append(time.perf_counter() - started)
    app.processEvents()
    return {k: _ms(v) for k, v in out.items()}


def screenshots(source: str, quantization: str, folder: Path, timeout_s: float) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.chat.conversations import ConversationStore
    from app.paths import asset_path
    from app.runtime import configure_for_gui
    from app.settings import AppSettings
    from app.window import MainWindow
    from engine.config import EngineConfig, ModelSpec, SamplingParams
    from widgets.theme import apply_theme

    folder.mkdir(parents=True, exist_ok=True)
    # transformers' lazy module imported here first: imported on the engine thread while this
    # thread touched it too, it failed to load ("cannot import name 'MinPLogitsWarper'")
    import engine.core.llm_engine  # noqa: F401

    configure_for_gui()
    app = QApplication.instance() or QApplication([])
    apply_theme(app, asset_path("style.qss"))  # the app's look, as a user sees it
    store = ConversationStore(folder / "conversations.db")
    window = MainWindow(AppSettings(), store, interactive=False)
    window.resize(1600, 1000)
    window.show()
    window.controls.sampling.set_params(SamplingParams(temperature=0.0, max_new_tokens=40, snapshot_top_n=10))
    state: dict[str, Any] = {"code": 1}

    def loaded(_event) -> None:
        print("loaded; sending the prompt", file=sys.stderr)
        window.controller.new_conversation()
        if not window.controller.send(PROMPT):
            failed("the prompt could not be sent")

    def finished(event) -> None:
        state["request"] = event.request_id
        window.host.render_tick()
        index = min(12, len(event.token_ids) - 1)
        window.controller.inspect_token(event.request_id, index)
        QTimer.singleShot(200, lambda: wait_for(lambda: window.inside.tokens.last_inside is not None, shoot))

    def wait_for(done, then, waited: list[float] = [0.0]) -> None:  # noqa: B006 - a counter
        if done():
            then()
            return
        waited[0] += 0.1
        if waited[0] > timeout_s:
            print("timed out", file=sys.stderr)
            app.quit()
            return
        QTimer.singleShot(100, lambda: wait_for(done, then, waited))

    def grab(name: str, widget) -> None:
        app.processEvents()
        path = folder / f"{name}.png"
        widget.grab().save(str(path))
        print(path)

    def shoot() -> None:
        views = window.inside
        grab("probabilities_and_lens", window.docks["probabilities"])
        grab("lens", views.lens)
        views.docks["attention"].raise_()
        QTimer.singleShot(300, shoot_attention)

    def shoot_attention() -> None:
        views = window.inside
        grab("attention", views.docks["attention"])
        grab("page_map", window.docks["page_map"])
        views.docks["experts"].raise_()
        window.inside.tokens.refresh()
        QTimer.singleShot(
            300, lambda: wait_for(lambda: "expert" in views.experts.title.text().lower(), shoot_experts)
        )

    def shoot_experts() -> None:
        views = window.inside
        grab("experts", views.docks["experts"])
        views.docks["score"].raise_()
        views.score.input.setPlainText(SCORE_TEXT)
        views.score.button.click()
        wait_for(lambda: views.score.score is not None, shoot_score)

    def shoot_score() -> None:
        views = window.inside
        QTimer.singleShot(200, lambda: grab("score", views.docks["score"]))
        views.docks["steering"].raise_()
        views.steering.positive.setText(POSITIVE)
        views.steering.negative.setText(NEGATIVE)
        views.steering.contrast_button.click()
        wait_for(lambda: "KL(steered" in views.steering.status.text(), shoot_steering)

    def shoot_steering() -> None:
        views = window.inside
        views.steering.strength.setValue(40)
        wait_for(lambda: "×+4.0" in views.steering.status.text(), finish)

    def finish() -> None:
        grab("steering", window.inside.docks["steering"])
        window.docks["probabilities"].raise_()
        app.processEvents()
        grab("window", window)
        state["code"] = 0
        window.close()
        app.quit()

    def failed(message: str) -> None:
        print(f"failed: {message}", file=sys.stderr)
        window.close()
        app.quit()

    window.host.model_loaded.connect(loaded)
    window.host.model_load_failed.connect(failed)
    window.host.request_failed.connect(lambda event: failed(event.message))
    window.controller.reply_refused.connect(failed)
    window.host.request_finished.connect(finished)
    window.start_engine(EngineConfig(model=ModelSpec(source, quantization=quantization)))
    app.exec()
    store.close()
    return int(state["code"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.inside_views", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--tokens", type=int, default=48, help="reply length to inspect")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--screenshots", type=Path, default=None, metavar="DIR")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.screenshots is not None:
        return screenshots(args.model, args.quantization, args.screenshots, args.timeout)
    result = measure(args.model, args.quantization, args.tokens, args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
