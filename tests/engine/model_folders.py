"""Hand-written model folders for loading and inspection tests: configs only, or a tiny real model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A Llama-3-8B-class config: 32 layers, 32 query heads over 8 KV heads of 128, untied head.
LLAMA_8B_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}

BERT_CONFIG = {
    "model_type": "bert",
    "architectures": ["BertForMaskedLM"],
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
}

VIT_CONFIG = {
    "model_type": "vit",
    "architectures": ["ViTForImageClassification"],
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 224,
}


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def save_tiny_model(folder: Path, tokenizer, **overrides) -> Path:
    """A tiny random Llama (see conftest.make_tiny_llama) saved with the real tokenizer."""
    from tiny_models import make_tiny_llama

    model = make_tiny_llama(vocab_size=len(tokenizer), **overrides)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def fake_hf_cache(
    root: Path, repo_id: str, files: dict, revision: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """The layout huggingface_hub writes: blobs behind a snapshot folder and a refs/main pointer.
    `files` maps a name in the repo to a dict (written as JSON) or a file to copy. Returns the
    snapshot folder."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, source in files.items():
        blob = repo / "blobs" / f"blob-{name.replace('/', '-')}"
        if isinstance(source, dict):
            blob.write_text(json.dumps(source))
        elif Path(source).stat().st_size > 1 << 20:  # a large file (a GGUF): linked, not copied
            blob.symlink_to(Path(source).resolve())
        else:
            shutil.copyfile(source, blob)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(blob)
    return snapshot
