"""Shared fixtures: a tiny random Llama with the packaged SmolLM2 tokenizer (seconds, offline,
deterministic) and the real packaged model for the slow end-to-end tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def make_tiny_llama(vocab_size: int = 49152, seed: int = 0, **overrides):
    """2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), fp32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    return model


class IdTokenizer:
    """Enough of a tokenizer for raw-token requests to a tiny model: ids print as <id>."""

    eos_token_id = 2

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids, **kwargs):
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text):
        return [ord(c) % self.vocab_size for c in text]

    def __len__(self):
        return self.vocab_size


@pytest.fixture(scope="session")
def default_tokenizer():
    from engine.loading import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def tiny_loaded(default_tokenizer):
    """A LoadedModel around a tiny random Llama that speaks the real SmolLM2 tokenizer."""
    from engine.loaded import LoadedModel

    model = make_tiny_llama(vocab_size=len(default_tokenizer))
    model.generation_config.eos_token_id = default_tokenizer.eos_token_id
    return LoadedModel.from_model(model, default_tokenizer, name="tiny-random-llama", source="test")


@pytest.fixture(scope="session")
def default_loaded():
    """The real packaged SmolLM2-135M-Instruct, fp32 on CPU (converted once, then cached)."""
    from engine.config import ModelSpec
    from engine.loading import load_model

    return load_model(ModelSpec("default", dtype="float32", device="cpu"))
