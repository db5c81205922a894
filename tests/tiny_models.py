"""Tiny models for tests: a random Llama small enough to build in a second, and a tokenizer
stand-in for raw-token requests. A plain module (not conftest) so test files can import it
whichever conftest pytest loaded first."""

from __future__ import annotations

import torch


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
