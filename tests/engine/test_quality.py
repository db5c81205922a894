"""Quality metrics on known distributions, on the tiny model, the shipped eval text, the
quant-report command, and (slow) the real model's int8 figures."""

import json
import math
import subprocess
import sys

import pytest
import torch
from tiny_models import make_tiny_llama

from engine.bench.quality import (
    compare_logits,
    compare_models,
    eval_token_ids,
    greedy_agreement,
    layer_output_errors,
)
from engine.model.logits import teacher_forced_logits
from engine.quant.schemes import quantize_model


def test_identical_logits_have_zero_kl_full_agreement_and_equal_perplexity():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    report = compare_logits(logits, logits.clone(), [3, 1, 4, 1, 5, 9])
    assert report.num_tokens == 5
    assert report.mean_kl == 0.0 and report.max_kl == 0.0
    assert report.top1_agreement == 1.0
    assert report.reference_perplexity == report.quantized_perplexity


def test_kl_top1_and_nll_on_hand_computed_distributions():
    half = math.log(0.5)
    reference = torch.tensor([[half, half], [math.log(0.9), math.log(0.1)], [0.0, 0.0]])
    quantized = torch.tensor([[math.log(0.9), math.log(0.1)], [math.log(0.2), math.log(0.8)], [0.0, 0.0]])
    report = compare_logits(reference, quantized, [0, 0, 1])  # predicts token 0, then token 1
    kl0 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    kl1 = 0.9 * math.log(0.9 / 0.2) + 0.1 * math.log(0.1 / 0.8)
    assert report.kl == pytest.approx((kl0, kl1), rel=1e-5)
    # position 0: reference is a tie (argmax picks token 0) and quantized prefers 0; position 1 flips
    assert report.top1_agree == (True, False)
    assert report.reference_nll == pytest.approx((-math.log(0.5), -math.log(0.1)), rel=1e-5)
    assert report.quantized_nll == pytest.approx((-math.log(0.9), -math.log(0.8)), rel=1e-5)
    assert report.quantized_perplexity == pytest.approx(math.exp((-math.log(0.9) - math.log(0.8)) / 2))


def test_uniform_logits_have_perplexity_equal_to_the_vocabulary():
    report = compare_logits(torch.zeros(4, 37), torch.zeros(4, 37), [1, 2, 3, 4])
    assert report.reference_perplexity == pytest.approx(37.0)


def test_mismatched_logits_are_refused():
    with pytest.raises(ValueError, match="do not both cover 3 tokens"):
        compare_logits(torch.zeros(3, 5), torch.zeros(3, 6), [1, 2, 3])


def test_identical_models_compare_equal_and_a_perturbed_one_does_not():
    reference = make_tiny_llama(vocab_size=300, seed=1)
    twin = make_tiny_llama(vocab_size=300, seed=1)
    ids = list(range(10, 60))
    same = compare_models(reference, twin, ids)
    assert same.mean_kl < 1e-9 and same.top1_agreement == 1.0
    other = make_tiny_llama(vocab_size=300, seed=2)
    different = compare_models(reference, other, ids)
    assert different.mean_kl > 1e-3


def test_int8_kv_path_is_close_to_the_plain_forward():
    model = make_tiny_llama(vocab_size=300, seed=4)
    ids = list(range(20, 90))
    plain = teacher_forced_logits(model, ids)
    report = compare_logits(plain, teacher_forced_logits(model, ids, kv_dtype="int8"), ids)
    assert 0 < report.mean_kl < 1e-3
    assert report.top1_agreement >= 0.95


def test_layer_output_errors_tell_a_quantized_layer_from_an_untouched_one():
    reference = make_tiny_llama(vocab_size=300, seed=5)
    untouched = layer_output_errors(reference, make_tiny_llama(vocab_size=300, seed=5))
    assert len(untouched) == 14 and set(untouched.values()) == {0.0}
    quantized = quantize_model(make_tiny_llama(vocab_size=300, seed=5), "int8-weight-only")
    errors = layer_output_errors(reference, quantized)
    assert errors.keys() == untouched.keys()
    assert all(0 < e < 0.01 for e in errors.values())  # int8 per-channel: about 0.4% per layer


def test_greedy_agreement_counts_prefix_and_positions():
    agreement = greedy_agreement([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6])
    assert (agreement.common_prefix, agreement.same_position, agreement.length) == (2, 4, 5)
    assert agreement.prefix_fraction == 0.4 and agreement.position_fraction == 0.8
    assert greedy_agreement([7, 8], [7, 8]).prefix_fraction == 1.0


def test_eval_text_is_a_few_hundred_tokens_of_prose(default_tokenizer):
    ids = eval_token_ids(default_tokenizer)
    assert 300 <= len(ids) <= 600
    assert default_tokenizer.eos_token_id not in ids


def test_quant_report_json_on_the_tiny_model(tmp_path, default_tokenizer):
    """Every scheme in one report: each row evaluates its own quantized model (every decoder
    linear replaced, each layer's output off its reference twin, a KL above zero), never the
    reference model or its logits again."""
    from model_folders import save_tiny_model

    from engine.quant.schemes import scheme_statuses

    folder = save_tiny_model(tmp_path / "tiny", default_tokenizer)
    # every scheme a model folder can take ('native' is for GGUF files)
    available = [
        s.name for s in scheme_statuses("cpu") if s.available and s.name not in ("auto", "none", "native")
    ]
    args = ["--model", str(folder), "--schemes", ",".join(available), "--rounds", "1", "--new-tokens", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "quant-report", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    none, *rows = report["schemes"]
    assert [none["scheme"]] + [r["scheme"] for r in rows] == ["none", *available]
    assert none["mean_kl"] == 0.0 and none["top1_agreement"] == 1.0 and none["greedy_prefix_match"] == 1.0
    assert none["reply_top1_agreement"] == 1.0 and none["layer_error_max"] == 0.0
    assert none["quantized_layers"] == 0
    for row in rows:
        assert "error" not in row, row
        assert row["quantized_layers"] == 14, row["scheme"]  # 2 layers x (4 attention + 3 MLP)
        # random weights are on no scheme's grid: every layer moves, and so does the distribution
        assert row["layer_error_median"] > 1e-3, row["scheme"]
        assert row["mean_kl"] > 0 and row["perplexity"] != none["perplexity"], row["scheme"]
        assert row["weight_bytes"] < none["weight_bytes"] and row["perplexity_none"] == none["perplexity"]
        assert 0.0 <= row["reply_top1_agreement"] <= 1.0
        for key in ("prefill_tok_s", "decode_tok_s", "load_s", "quantize_s"):
            assert row[key] > 0, (row["scheme"], key)
    assert report["eval_tokens"] == len(eval_token_ids(default_tokenizer))


def test_quant_report_refuses_an_unknown_scheme_by_name(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "quant-report", "--model", str(tmp_path), "--schemes", "none,int5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "Unknown quantization scheme 'int5'" in proc.stderr


@pytest.mark.slow
def test_real_model_int8_weight_only_and_int8_kv_stay_close_to_fp32(default_loaded):
    """SmolLM2-135M on the first 128 eval tokens: int8 weight-only agrees with fp32 on the
    top-1 token at most positions, and so does the int8 KV cache."""
    from engine.config import ModelSpec
    from engine.model.loading import load_model

    ids = eval_token_ids(default_loaded.tokenizer)[:128]
    reference = teacher_forced_logits(default_loaded.model, ids)
    kv = compare_logits(reference, teacher_forced_logits(default_loaded.model, ids, kv_dtype="int8"), ids)
    quantized = load_model(ModelSpec("default", "float32", "cpu", quantization="int8-weight-only")).model
    weights = compare_logits(reference, teacher_forced_logits(quantized, ids), ids)
    for report in (kv, weights):
        assert report.top1_agreement >= 0.9
        assert report.mean_kl < 0.05
        assert abs(report.quantized_perplexity / report.reference_perplexity - 1) < 0.05
