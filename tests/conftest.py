"""Shared fixtures: a tiny random Llama with the packaged SmolLM2 tokenizer (seconds, offline,
deterministic) and the real packaged model for the slow end-to-end tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from tiny_models import make_tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def own_runtime_memory_file(tmp_path, monkeypatch):
    """What a first load added to a process (engine.model.runtime_memory) is kept per machine for
    the next fresh process: tests keep theirs apart from the user's."""
    from engine.model import runtime_memory

    monkeypatch.setattr(runtime_memory, "_file", lambda: tmp_path / runtime_memory.FILE_NAME)


@pytest.fixture(scope="session")
def default_tokenizer():
    from engine.model.default_model import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def tiny_loaded(default_tokenizer):
    """A LoadedModel around a tiny random Llama that speaks the real SmolLM2 tokenizer."""
    from engine.model.loaded import LoadedModel

    model = make_tiny_llama(vocab_size=len(default_tokenizer))
    model.generation_config.eos_token_id = default_tokenizer.eos_token_id
    return LoadedModel.from_model(model, default_tokenizer, name="tiny-random-llama", source="test")


@pytest.fixture(scope="session")
def default_loaded():
    """The real packaged SmolLM2-135M-Instruct, fp32 on CPU (converted once, then cached)."""
    from engine.config import ModelSpec
    from engine.model.loading import load_model

    return load_model(ModelSpec("default", dtype="float32", device="cpu", quantization="none"))
