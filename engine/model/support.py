"""Which model families kvscope serves, decided from the config before any weight is read.

A family is served only when a tiny random model of it gives transformers' own greedy tokens
through the paged engine under every block size, chunking and prefix-cache setting of the parity
tests (tests/engine/test_family_parity.py parametrizes over SUPPORTED, so a family cannot be
listed here without its test). Every other `model_type` transformers can load is refused with
the reason in one line: what its architecture does that paged attention does not, or, for one
that might work but has no parity test, that it is not verified. Never silently wrong.

After the weights load, `engine.model.layer_attention.probe_attention` checks the same thing from
the other side, on the real model: what each layer's attention is called with.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from engine.errors import ModelLoadError

# model_type -> the family's name. Each has a tiny config in tests/family_configs.py.
SUPPORTED: dict[str, str] = {
    "afmoe": "AFMoE",
    "apertus": "Apertus",
    "apertus1p5_text": "Apertus 1.5",
    "arcee": "Arcee (AFM)",
    "aria_text": "Aria (text)",
    "beam": "Beam",
    "biogpt": "BioGPT",
    "bitnet": "BitNet",
    "cohere": "Cohere (Command R)",
    "cohere2": "Cohere 2 (Command R7B, A)",
    "cohere2_moe": "Cohere 2 MoE",
    "ctrl": "CTRL",
    "cwm": "CWM",
    "dots1": "dots.llm1",
    "ernie4_5": "ERNIE 4.5",
    "ernie4_5_moe": "ERNIE 4.5 MoE",
    "exaone": "EXAONE 3",
    "exaone4": "EXAONE 4",
    "exaone_moe": "EXAONE MoE",
    "flex_olmo": "FlexOlmo",
    "flint": "Flint",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "glm": "GLM",
    "glm4": "GLM-4",
    "glm4_moe": "GLM-4 MoE",
    "gpt2": "GPT-2 (and GPT-SW3)",
    "gpt_bigcode": "GPT-BigCode (StarCoder)",
    "gpt_neox": "GPT-NeoX (Pythia)",
    "gpt_oss": "gpt-oss",
    "gptj": "GPT-J",
    "codegen": "CodeGen",
    "granite": "Granite",
    "granite_swa": "Granite SWA",
    "granitemoe": "Granite MoE",
    "granitemoe_swa": "Granite MoE SWA",
    "granitemoeshared": "Granite MoE (shared experts)",
    "helium": "Helium",
    "hunyuan_v1_dense": "Hunyuan",
    "hy_v3": "HY v3",
    "hyperclovax": "HyperCLOVA X",
    "internlm3": "InternLM 3",
    "iquestcoder": "IQuest-Coder",
    "jais2": "Jais 2",
    "kolibri1": "Kolibri",
    "laguna": "Laguna",
    "llama": "Llama",
    "mellum": "Mellum",
    "minimax_m2": "MiniMax-M2",
    "minimax_m3_vl_text": "MiniMax-M3 (text)",
    "ministral": "Ministral",
    "ministral3": "Ministral 3",
    "mistral": "Mistral",
    "mixtral": "Mixtral",
    "modernbert-decoder": "ModernBERT decoder",
    "nanochat": "nanochat",
    "nemotron": "Nemotron",
    "olmo": "OLMo",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3",
    "olmoe": "OLMoE",
    "opt": "OPT",
    "persimmon": "Persimmon",
    "phi": "Phi (1, 1.5, 2)",
    "phi3": "Phi-3, Phi-4",
    "phimoe": "Phi-3.5-MoE",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen2_moe": "Qwen2 MoE",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3 MoE",
    "sarvam_moe": "Sarvam MoE",
    "seed_oss": "Seed-OSS",
    "smollm3": "SmolLM3",
    "solar_open": "Solar Open",
    "stablelm": "StableLM",
    "starcoder2": "Starcoder2",
    "vaultgemma": "VaultGemma",
}

# Attention layer kinds paged attention implements (transformers' `layer_types` names).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# What a family's attention does that paged attention does not, where its config does not show it.
_FAMILY_REASONS: dict[str, str] = {
    "bloom": "its ALiBi position biases are computed inside its own attention code",
    "mpt": "its ALiBi position biases are computed inside its own attention code",
    "falcon": "transformers' Falcon computes its attention inline (SDPA or ALiBi), not through the "
    "attention functions kvscope's paged attention replaces",
    "gpt_neo": "transformers' GPT-Neo computes its local and global attention inline, not through the "
    "attention functions kvscope's paged attention replaces",
    "openai-gpt": "transformers' GPT-1 computes its attention inline, not through the attention "
    "functions kvscope's paged attention replaces",
    "xglm": "transformers' XGLM computes its attention inline, not through the attention functions "
    "kvscope's paged attention replaces",
    "gpt_neox_japanese": "transformers' GPT-NeoX-Japanese computes its attention inline, not through the "
    "attention functions kvscope's paged attention replaces",
    "cpmant": "its attention adds learned relative position biases inside its own attention code",
    "hrm_text": "its recurrent reasoning blocks compute attention inline, not through the attention "
    "functions kvscope's paged attention replaces",
    "diffllama": "its differential attention subtracts two attention maps per layer; paged attention computes one",
    "doge": "its dynamic mask attention adds a learned mask of its own to every layer",
    "llama4_text": "its chunked-attention layers see only their own chunk, a mask paged attention does not apply",
    "inkling_text": "its hybrid layers pass a position bias to attention, which paged attention does not apply",
    "moshi": "it is a speech model: its depth decoder generates audio codes, not text",
    "reformer": "its LSH and local attention are not standard causal attention",
    "xlnet": "it is a permutation language model with two-stream attention, not causal attention",
    "mimo_v2_flash": "its sliding and full layers have different numbers of KV heads (and value widths), "
    "while the paged KV pool has one shape for every layer",
    "deepseek_v4": "its compressed sparse attention layers select keys in a way paged attention does not reproduce",
    "lfm2": "its short-convolution layers keep a state besides attention K/V, which the paged KV cache does not hold",
    "lfm2_moe": "its short-convolution layers keep a state besides attention K/V, which the paged KV cache does not hold",
    "jetmoe": "its mixture-of-attention layers tile the K/V heads across attention experts after the cache "
    "(query head h reads K/V head h mod kv_heads), which paged attention's grouped heads do not",
    "cohere_compass_text": "it is an embedding (retrieval) model, not a chat model",
    # parity held until kvscope's kernel layers replaced nn.Linear: its MoE router reads `gate.weight`
    "hunyuan_v1_moe": "its MoE router reads a linear layer's weight directly, which kvscope's kernel "
    "layers (engine/kernels/linear.py) do not expose yet",
    "gemma3n_text": "its later layers reuse earlier layers' K/V (KV sharing) and its per-layer inputs have "
    "no place in paged attention",
}
# Configs whose layers differ in shape (transformers' per-layer configs): one KV pool shape cannot hold them.
_HETEROGENEOUS = (
    "its layers differ in shape (per-layer head sizes or KV heads), while the paged KV pool has one shape "
    "for every layer"
)

# Recurrent / state-space families (no `layer_types` saying so in every version of their config).
_RECURRENT = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma"})


@dataclass(frozen=True, slots=True)
class Support:
    model_type: str
    family: str | None  # the family's name when served
    refusal: str | None  # why it is not, in one line (no final full stop)

    @property
    def ok(self) -> bool:
        return self.refusal is None


def _attr(config: object, name: str) -> Any:
    """config.name, or None; heterogeneous (per-layer) configs raise on ambiguous global reads."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and friends
        return None


def _text_config(config: Any) -> Any:
    """The text part of a config (its own fields are dynamic: Any)."""
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 - several text configs (audio models): use the top one
        return config


def _auto_mappings() -> ModuleType:
    # transformers takes seconds to import: only once a model is read
    from transformers.models.auto import modeling_auto as m

    return m


def _architecture_refusal(model_type: str, config: object) -> str | None:
    """What the architecture does that paged attention does not, read from the config."""
    m = _auto_mappings()
    text = _text_config(config)
    if (
        _attr(config, "is_encoder_decoder")
        or model_type in m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        or model_type in m.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
        or model_type in ("trocr", "prophetnet", "musicgen", "musicgen_melody", "moss_transcribe_diarize")
    ):
        return (
            "it is the decoder of an encoder-decoder model (translation, summarisation, speech or OCR); "
            "kvscope serves decoder-only chat models"
        )
    if model_type in m.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in (
        "bert-generation",
        "big_bird",
        "megatron-bert",
        "roformer",
        "rembert",
        "xmod",
    ):
        return "it is an encoder (BERT-style) model with a language-model head, not a chat model"
    subs = set(_attr(config, "sub_configs") or {})
    if subs & {"vision_config", "audio_config", "vq_config", "audio_encoder_config"} or model_type in (
        "git",
        "fuyu",
        "blt",
    ):
        return "it is a multimodal model (images or audio with text); kvscope serves text-only chat models"
    if model_type in _RECURRENT:
        return "it is a recurrent (state-space) model: it keeps a running state, not attention K/V, so there is nothing to page"
    kinds = sorted(set(_attr(text, "layer_types") or ()) - ATTENTION_LAYER_TYPES)
    recurrent = [k for k in kinds if k in ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")]
    if recurrent:
        return (
            f"its {', '.join(recurrent)} layers keep a recurrent state besides attention K/V, which the paged "
            "KV cache does not hold"
        )
    if kinds:
        return f"its {', '.join(kinds)} layers attend in a way paged attention does not reproduce"
    if _attr(text, "kv_lora_rank") or _attr(text, "qk_rope_head_dim"):
        return (
            "it uses multi-head latent attention (keys and values of different widths), while the paged KV "
            "pool stores one head width"
        )
    if _attr(text, "alibi"):
        return (
            "its positions are ALiBi biases added to the attention scores, which paged attention does not add"
        )
    try:
        text.head_dim  # noqa: B018 - per-layer configs raise on an ambiguous global read
    except AttributeError:
        pass
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError
        return _HETEROGENEOUS
    return None


def support_for(config: object) -> Support:
    """Whether kvscope serves this config's model, and if not why (config only, no weights).
    `config`: a transformers config, or anything with its attributes (the Hub's config excerpt)."""
    model_type = _attr(config, "model_type") or "?"
    family = SUPPORTED.get(model_type)
    if family is not None:
        return Support(model_type, family, _checkpoint_refusal(config))
    reason = _FAMILY_REASONS.get(model_type) or _architecture_refusal(model_type, config)
    if reason is None:
        reason = (
            f"kvscope has no parity test for '{model_type}' models yet, so it refuses them rather than risk "
            "tokens that differ from transformers'"
        )
    return Support(model_type, None, reason)


def _checkpoint_refusal(config: object) -> str | None:
    """A served family's checkpoint can still switch on what paged attention lacks."""
    text = _text_config(config)
    kinds = sorted(set(_attr(text, "layer_types") or ()) - ATTENTION_LAYER_TYPES)
    if kinds:
        return f"this checkpoint has {', '.join(kinds)} layers, which paged attention does not implement"
    return None


def check_support(config: object, name: str) -> Support:
    """Raise ModelLoadError with the one-line reason when kvscope does not serve `config`."""
    support = support_for(config)
    if not support.ok:
        raise ModelLoadError(f"{name} cannot be served: {support.refusal}.")
    return support
