"""Quantization in the app on the tiny model: the picker's schemes (unavailable ones greyed out
with their reason), a real load with a scheme (weights series, picker line), and quality runs
through the window (KL 0 / agreement 1 for 'none' against itself, positive KL for int8)."""

from __future__ import annotations

import threading

import pytest
import torch
from app_windows import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS
from PySide6.QtCore import Qt

from app.models.picker import ModelPicker
from app.quality.compute import compute_quality
from app.quality.controller import THREAD_NAME
from app.quality.jobs import CONVERSATION, EVAL_TEXT, QualityJob, QualityUnavailable
from app.settings import ModelChoice
from engine.config import ModelSpec, SamplingParams
from engine.measure.memory import AVAILABLE_MEMORY_ENV
from engine.quant.schemes import get_scheme
from engine.shapes import ModelShapes

QUALITY_TIMEOUT_MS = 180_000
INT8 = "int8-weight-only"


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tiny_loaded):
    """The tiny random Llama saved as an HF folder: loaded through the real loader, so a scheme
    is applied exactly as for any model the user picks."""
    from tiny_models import make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    # the same weights as tiny_loaded's (same seed), saved before any serving-time fusion: a
    # served model's fused projections are not its checkpoint's parameters
    make_tiny_llama(vocab_size=len(tiny_loaded.tokenizer)).save_pretrained(folder)
    tiny_loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def no_quality_thread_left():
    yield
    alive = [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]
    assert not alive, "a quality run outlived its test"


def make_picker(qtbot, **choice) -> ModelPicker:
    picker = ModelPicker(ModelChoice(**choice), 1 << 20)
    qtbot.addWidget(picker)
    picker.wait_for_estimate()
    return picker


# ---- the picker --------------------------------------------------------------------------------
def test_an_unavailable_scheme_is_disabled_with_its_reason(qtbot, monkeypatch):
    reason = "it needs a float8 matmul this test pretends is missing"
    monkeypatch.setattr(get_scheme("fp8-e4m3"), "check", lambda device: (False, reason))
    picker = make_picker(qtbot, device="cpu")
    q = picker.quantization
    assert not q.is_enabled("fp8-e4m3")
    index = q.scheme.findData("fp8-e4m3")
    assert reason in q.scheme.itemData(index, Qt.ItemDataRole.ToolTipRole)
    assert "(unavailable)" in q.scheme.itemText(index)
    assert not q.unavailable.isHidden() and f"fp8-e4m3: {reason}" in q.unavailable.text()
    others = [s.name for s in q.statuses if s.name != "fp8-e4m3"]
    assert all(q.is_enabled(name) == get_scheme(name).available("cpu")[0] for name in others)
    # a saved choice of it stays chosen (never swapped for another scheme) and says why it cannot run
    picker.set_choice(ModelChoice(device="cpu", quantization="fp8-e4m3"))
    assert picker.choice().quantization == "fp8-e4m3"
    assert q.note.text() == f"fp8-e4m3 cannot run here: {reason}."


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a usable GPU")
def test_on_cuda_without_a_gpu_every_scheme_is_greyed_out_with_the_reason(qtbot):
    picker = make_picker(qtbot, device="cpu")
    assert picker.quantization.is_enabled(INT8)
    picker.device.setCurrentText("cuda")
    q = picker.quantization
    assert not any(q.is_enabled(s.name) for s in q.statuses)
    assert "every scheme" in q.unavailable.text() and "cuda" in q.unavailable.text()
    picker.device.setCurrentText("cpu")
    assert q.is_enabled(INT8)


def test_the_choice_carries_scheme_and_kv_dtype_into_the_engine_config(qtbot):
    picker = make_picker(qtbot, device="cpu", quantization=INT8, kv_dtype="int8")
    config = picker.choice().engine_config()
    assert config.model.quantization == INT8 and config.kv_dtype == "int8"


def test_command_line_scheme_and_kv_dtype_reach_the_choice_and_the_picker(qtbot):
    from app.main import model_choice, parse_args
    from engine.quant.schemes import QuantizationError

    args = parse_args(["--prompt", "hi", "--quantization", INT8, "--kv-dtype", "int8"])
    choice = model_choice(args, ModelChoice())
    config = choice.engine_config()
    assert config.model.quantization == INT8 and config.kv_dtype == "int8"
    picker = make_picker(qtbot)  # the window's picker gets the launch's choice the same way
    picker.set_choice(choice)
    assert (picker.quantization.scheme_name(), picker.quantization.kv_dtype_name()) == (INT8, "int8")
    with pytest.raises(QuantizationError, match="Unknown quantization scheme 'int5'.*int8-weight-only"):
        model_choice(parse_args(["--quantization", "int5"]), ModelChoice())


# ---- loading with a scheme ---------------------------------------------------------------------
def load(qtbot, window, folder, scheme: str, kv_dtype: str = "auto"):
    choice = ModelChoice(
        source=str(folder), device="cpu", kv_budget_mib=1, quantization=scheme, kv_dtype=kv_dtype
    )
    window.controls.model.set_choice(choice)
    with qtbot.waitSignal(window.host.model_loaded, timeout=LOAD_TIMEOUT_MS) as loaded:
        window.controls.model.load_button.click()
    # the memory timeline runs on across loads: wait for a sample this model's engine took
    # (one taken before it, by the previous model, may still be the last on a slow machine)
    engine_info = loaded.args[0].info
    live = window.host.live
    qtbot.waitUntil(
        lambda: len(live.memory) > 0 and live.memory.column("weights")[-1] == engine_info.weight_bytes,
        timeout=LOAD_TIMEOUT_MS,
    )
    window.panels.memory.refresh({"memory"})
    return loaded.args[0]


def test_loading_with_a_scheme_updates_the_weights_series(make_window, qtbot, tiny_folder):
    window = make_window(start=False)
    memory = window.panels.memory
    full = load(qtbot, window, tiny_folder, "none")
    assert memory.full_precision is None and "weights (tensor sizes)" in memory.legend.text()

    event = load(qtbot, window, tiny_folder, INT8, kv_dtype="int8")
    info = event.info
    _, weights = memory.series("weights")
    unit = memory.unit[1]
    assert weights[-1] == pytest.approx(info.weight_bytes / unit)  # the engine's figure after quantizing
    assert info.weight_bytes < full.info.weight_bytes
    assert info.params == full.info.params  # the loader keeps the count before quantizing
    assert (info.quantization, full.info.quantization) == (INT8, "none")
    assert info.weight_bytes_before == full.info.weight_bytes  # the engine's count before quantizing
    assert memory.full_precision == (info.weight_bytes_before, "float32")
    assert memory.full_precision_line.value() == pytest.approx(info.weight_bytes_before / unit)
    assert f"weights, {INT8} (tensor sizes)" in memory.legend.text()
    line = window.controls.model.quantization.loaded.text()
    assert INT8 in line and "in float32" in line and "KV int8" in line
    # how the engine runs it, as it reported: the forward, its threads, the measured kernel table
    assert all(note in line for note in info.notes) and "engine threads" in line
    assert "kernels int8-row: " in line
    # the int8 pool: more pages in the same 1 MiB than the float32 one had
    assert event.kv_num_blocks >= 2 * full.kv_num_blocks


# ---- quality runs ------------------------------------------------------------------------------
def run_quality(qtbot, window, source: str):
    panel = window.panels.quality
    panel.source.setCurrentIndex(panel.source.findData(source))
    with qtbot.waitSignal(window.quality.finished, timeout=QUALITY_TIMEOUT_MS) as done:
        panel.run_button.click()
    window.quality.shutdown()
    return done.args[0]


def test_none_against_itself_reads_zero_kl_full_agreement_and_the_overlay_matches_the_reply(
    make_window, qtbot, tiny_folder, no_quality_thread_left
):
    window = make_window(start=False)
    load(qtbot, window, tiny_folder, "none")
    window.controls.sampling.set_params(
        SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, snapshot_top_n=5)
    )
    with qtbot.waitSignal(window.host.request_finished, timeout=REPLY_TIMEOUT_MS) as reply:
        window.controller.send("Hello there")
    event = reply.args[0]

    result = run_quality(qtbot, window, CONVERSATION)
    report = result.report
    assert report.mean_kl == 0.0 and report.max_kl == 0.0
    assert report.top1_agreement == 1.0
    assert report.quantized_perplexity == report.reference_perplexity
    assert "top-1 agreement <b>100.0%</b>" in window.panels.quality.figures_text()
    # the reply's exact tokens close the text, and each has the reference where the engine sampled it
    assert result.token_ids[-6:] == event.token_ids and result.reply_start == len(result.token_ids) - 6
    assert sorted(result.reference) == list(range(6))
    view = window.host.live.requests[event.request_id]
    for index, token in enumerate(view.tokens):
        ref = window.quality.reference_at(event.request_id, index)
        raw = token.snapshot.stages[0]
        for cid, p in zip(token.snapshot.candidate_ids, raw.probs):
            assert ref.probs[cid] == pytest.approx(p, abs=1e-4)  # the same model, the same position
        assert ref.top_id == token.token_id  # greedy: the reference's top token is the one drawn
    window.controller.inspect_token(event.request_id, 2)
    panel = window.panels.probabilities
    assert panel.reference is not None and not panel.reference_note.isHidden()
    assert [r.reference_prob for r in panel.rows] == [
        pytest.approx(p, abs=1e-4) for p in view.tokens[2].snapshot.stages[0].probs
    ]


def test_a_quantized_tiny_model_has_positive_kl_and_its_speed_measured(
    make_window, qtbot, tiny_folder, no_quality_thread_left
):
    window = make_window(start=False)
    load(qtbot, window, tiny_folder, INT8)
    result = run_quality(qtbot, window, EVAL_TEXT)
    report = result.report
    assert result.scheme == INT8 and report.num_tokens == len(result.token_ids) - 1
    assert report.mean_kl > 0.0 and all(kl >= 0.0 for kl in report.kl)
    assert window.panels.quality.kl_series()[1].tolist() == list(report.kl)
    for speed in (result.quantized_speed, result.reference_speed):
        assert speed.new_tokens == 32 and speed.decode_tok_s > 0 and speed.prefill_tok_s > 0
    text = window.panels.quality.figures_text()
    assert f"decode | <b>{result.quantized_speed.decode_tok_s:.1f}</b> tok/s" in text
    assert f"{result.reference_speed.decode_tok_s:.1f} tok/s" in text


def test_a_run_before_any_model_says_what_to_do(make_window, qtbot):
    window = make_window(start=False)
    window.panels.quality.run_button.click()
    assert window.panels.quality.status.text().startswith("Load a model first")
    assert not window.quality.running


def test_short_memory_is_said_instead_of_running_the_reference(tiny_folder, monkeypatch):
    from engine.model.configs import read_config
    from engine.model.sources import resolve_source

    shapes = ModelShapes.from_config(read_config(resolve_source(str(tiny_folder))))
    # room for the weights (the quantized copy loads) but not for the reference's logits too
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, str(shapes.weight_bytes("float32") + (1 << 20)))
    job = QualityJob(
        ModelSpec(str(tiny_folder), device="cpu", quantization=INT8), "auto", EVAL_TEXT, speed_tokens=0
    )
    with pytest.raises(QualityUnavailable, match="Not enough memory to run the full-precision reference"):
        compute_quality(job)


def test_a_long_conversation_keeps_its_last_tokens_and_the_reply_position(tiny_loaded, monkeypatch):
    from engine.bench import quality_run
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.request import ChatMessage, Request

    messages = (ChatMessage("user", "Tell me about the sea, the sky and the wind in a few words."),)
    prompt = LLMEngine(tiny_loaded, EngineConfig(num_blocks=1)).prompt_ids(Request(messages=messages))
    reply_ids = (101, 102, 103)
    monkeypatch.setattr(quality_run, "MAX_TOKENS", len(prompt) - 5)

    def token_ids(prompt_tokens: int):
        # the run's text for a job whose reply the engine counted `prompt_tokens` of prompt for
        return quality_run._token_ids(tiny_loaded, ModelSpec("test"), messages, reply_ids, prompt_tokens)

    ids, start, cut = token_ids(len(prompt))
    assert cut == 8 and len(ids) == len(prompt) - 5
    assert ids == [*prompt, *reply_ids][8:]
    assert start == len(prompt) - 8 and tuple(ids[start:]) == reply_ids
    # a prompt that no longer matches the engine's count: the text is compared, without positions
    ids, start, _ = token_ids(len(prompt) + 1)
    assert start is None and tuple(ids[-3:]) == reply_ids
