"""The support decision: every model_type transformers can load as a causal LM is either served
(with the parity tests of tests/engine/test_family_parity.py) or refused before its weights load,
with the reason in one line; and the load-time probe refuses what the config does not show."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from family_configs import tiny_config
from model_folders import LLAMA_8B_CONFIG, write_config

from engine.config import ModelSpec
from engine.errors import ModelLoadError
from engine.model.layer_attention import AttentionProbeError, mask_shape, probe_attention
from engine.model.loading import load_model
from engine.model.support import SUPPORTED, check_support, support_for
from engine.shapes import ModelShapes


def default_config(model_type: str):
    from transformers import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a few configs need arguments: decide by model_type alone
            return SimpleNamespace(model_type=model_type)


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_every_causal_lm_type_is_served_or_refused_in_one_line():
    decided = {}
    for model_type in causal_lm_types():
        support = support_for(default_config(model_type))
        if support.ok:  # (an alias such as gpt-sw3 builds its base family's config: gpt2)
            assert support.model_type in SUPPORTED
        else:
            assert support.refusal and "\n" not in support.refusal and len(support.refusal) < 240
        decided[support.model_type] = support.ok
    assert set(SUPPORTED) <= {t for t, ok in decided.items() if ok}, (
        "every listed family is one transformers knows"
    )
    for model_type in SUPPORTED:  # and each has a tiny config the parity tests build
        assert tiny_config(model_type).model_type == model_type


# One representative per reason, with what the message must name.
REFUSALS = {
    "bert": "encoder (BERT-style)",
    "bart": "encoder-decoder",
    "whisper": "encoder-decoder",
    "gemma3": "multimodal",
    "llama4": "multimodal",
    "mamba": "recurrent (state-space)",
    "jamba": "linear_attention layers keep a recurrent state",
    "qwen3_next": "linear_attention layers keep a recurrent state",
    "falcon_h1": "hybrid layers keep a recurrent state",
    "deepseek_v3": "multi-head latent attention",
    "deepseek_v32": "indexed_attention layers",
    "gemma4_text": "layers differ in shape",
    "gemma3n_text": "KV sharing",
    "bloom": "ALiBi",
    "mpt": "ALiBi",
    "falcon": "computes its attention inline",
    "gpt_neo": "computes its local and global attention inline",
    "llama4_text": "chunked-attention",
    "diffllama": "differential attention",
    "jetmoe": "tile the K/V heads",
    "mimo_v2_flash": "different numbers of KV heads",
    "lfm2": "short-convolution",
    "moshi": "speech model",
    "dbrx": "no parity test for 'dbrx'",
}


@pytest.mark.parametrize("model_type", list(REFUSALS))
def test_refusal_names_the_reason(model_type):
    support = support_for(default_config(model_type))
    assert not support.ok and REFUSALS[model_type] in support.refusal


def test_a_served_family_checkpoint_with_a_layer_kind_paged_attention_lacks_is_refused():
    config = tiny_config("qwen2")
    config.layer_types = ["full_attention", "linear_attention"]
    support = support_for(config)
    assert not support.ok and "linear_attention" in support.refusal


@pytest.mark.parametrize(
    "raw, reason",
    [
        ({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "recurrent (state-space)"),
        ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "latent attention"),
        ({"model_type": "bloom", "architectures": ["BloomForCausalLM"]}, "ALiBi"),
    ],
)
def test_a_refused_folder_fails_before_its_weights_load(tmp_path, raw, reason):
    folder = write_config(tmp_path / raw["model_type"], raw)  # a config and no weights at all
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelSpec(str(folder), dtype="float32", device="cpu"))
    message = str(err.value)
    assert "cannot be served" in message and reason in message and "\n" not in message
    assert "weight files" not in message  # refused on the config, not for the missing weights


def test_a_served_family_passes_the_check():
    folder_config = json.loads(json.dumps(LLAMA_8B_CONFIG))
    from transformers import LlamaConfig

    assert check_support(LlamaConfig(**folder_config), "llama-8b").family == "Llama"


# ---- the probe: what the real model's attention is called with ----------------------------
def probe(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    if overrides:  # a config of the family's own small sizes with what the test needs
        config = CONFIG_MAPPING[model_type](**{**tiny_config(model_type).to_diff_dict(), **overrides})
    else:
        config = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    except ValueError:  # no SDPA for this family (Gemma 2, Bloom): its eager attention
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return probe_attention(model, ModelShapes.from_config(model.config))


def test_the_probe_reads_each_layers_window_soft_cap_and_sinks():
    gemma2 = probe("gemma2")
    assert [(a.window, a.softcap) for a in gemma2] == [(8, 5.0), (None, 5.0)]
    assert [a.sinks for a in probe("gpt_oss")] == [True, True]
    assert [a.window for a in probe("mistral")] == [8, 8]
    # Phi-MoE passes no window to its attention: the probe reads it from the mask it builds
    assert [a.window for a in probe("phimoe")] == [8, 8]
    assert [a.window for a in probe("llama")] == [None, None]


@pytest.mark.parametrize(
    "model_type, reason",
    [
        ("bloom", "process the attention mask themselves"),  # its ALiBi, added to the mask
        ("gpt_neo", "process the attention mask themselves"),
        ("xglm", "process the attention mask themselves"),
        ("hrm_text", "compute attention by hand"),
        ("diffllama", "attends 2 times per token"),
        ("doge", "process the attention mask themselves"),
        ("llama4_text", "neither causal nor a sliding window"),
        ("jetmoe", "K/V of (heads, width)"),
    ],
)
def test_the_probe_refuses_attention_that_paged_attention_does_not_do(model_type, reason):
    overrides = {
        "llama4_text": {"attention_chunk_size": 4},
    }.get(model_type, {})
    with pytest.raises(AttentionProbeError) as err:
        probe(model_type, **overrides)
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_mask_shapes_are_read_from_transformers_mask_functions():
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        chunked_overlay,
        sliding_window_overlay,
    )

    assert mask_shape(causal_mask_function).kind == "causal"
    for window in (1, 8, 512, 4096, 131072):
        shape = mask_shape(and_masks(sliding_window_overlay(window), causal_mask_function))
        assert (shape.kind, shape.window) == ("sliding", window)
    assert mask_shape(bidirectional_mask_function).kind == "other"
    chunked = and_masks(chunked_overlay(64, torch.zeros(1, dtype=torch.long)), causal_mask_function)
    assert mask_shape(chunked).kind == "other"
