"""Models other apps keep on this machine: LM Studio's and GPT4All's model folders and Ollama's
store, each as a source `load_model` takes, with its size on disk (the Hugging Face cache's are
engine.hub.cache's; `engine.hub.cache.find_local_models` lists both).

- LM Studio: `~/.lmstudio/models` (and the older `~/.cache/lm-studio/models`), publisher/model/
  file.gguf; $LMSTUDIO_MODELS_DIR first when set.
- GPT4All: its app-data folder (Linux ~/.local/share/nomic.ai/GPT4All, macOS ~/Library/Application
  Support/nomic.ai/GPT4All, Windows %LOCALAPPDATA%/nomic.ai/GPT4All), *.gguf.
- Ollama: $OLLAMA_MODELS or ~/.ollama/models (the Linux service keeps /usr/share/ollama/.ollama/
  models). Each manifest (manifests/<registry>/<namespace>/<model>/<tag>, JSON) names its layers;
  the one of media type `application/vnd.ollama.image.model` is a GGUF blob in blobs/sha256-<hex>.
Scanning reads directory listings and small JSON files only, never a model.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True, slots=True)
class LocalModel:
    source: str  # what load_model / inspect_model take
    name: str  # what the user recognises: repo id, file name, ollama name:tag
    where: str  # "HF cache", "LM Studio", "GPT4All", "Ollama"
    size_bytes: int


def _home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def lmstudio_dirs() -> list[Path]:
    override = os.environ.get("LMSTUDIO_MODELS_DIR")
    dirs = [Path(override)] if override else []
    return dirs + [_home() / ".lmstudio" / "models", _home() / ".cache" / "lm-studio" / "models"]


def gpt4all_dirs() -> list[Path]:
    if sys.platform == "darwin":
        return [_home() / "Library" / "Application Support" / "nomic.ai" / "GPT4All"]
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        return [Path(local) / "nomic.ai" / "GPT4All"] if local else []
    data = Path(os.environ.get("XDG_DATA_HOME") or _home() / ".local" / "share")
    return [data / "nomic.ai" / "GPT4All"]


def ollama_dirs() -> list[Path]:
    override = os.environ.get("OLLAMA_MODELS")
    if override:
        return [Path(override)]
    return [_home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def _ggufs(root: Path, where: str, depth: int) -> list[LocalModel]:
    if not root.is_dir():
        return []
    found = []
    pattern = "/".join(["*"] * depth)
    for path in sorted(root.glob(f"{pattern}.gguf") if depth else root.glob("*.gguf")):
        if path.is_file() and not path.name.startswith(("mmproj", ".")):  # vision projectors are no LMs
            found.append(LocalModel(str(path), path.relative_to(root).as_posix(), where, path.stat().st_size))
    return found


def lmstudio_models() -> list[LocalModel]:
    """GGUF files at <models>/<publisher>/<model>/<file>.gguf."""
    seen, out = set(), []
    for root in lmstudio_dirs():
        for model in _ggufs(root, "LM Studio", 3) + _ggufs(root, "LM Studio", 2):
            if model.source not in seen:
                seen.add(model.source)
                out.append(model)
    return out


def gpt4all_models() -> list[LocalModel]:
    return [m for root in gpt4all_dirs() for m in _ggufs(root, "GPT4All", 0)]


def ollama_models() -> list[LocalModel]:
    out = []
    for root in ollama_dirs():
        manifests = root / "manifests"
        if not manifests.is_dir():
            continue
        for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
            model = _ollama_model(root, manifests, manifest)
            if model is not None:
                out.append(model)
    return out


def _ollama_model(root: Path, manifests: Path, manifest: Path) -> LocalModel | None:
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
    except (OSError, ValueError, AttributeError):
        return None
    for layer in layers:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER:
            blob = root / "blobs" / str(layer.get("digest", "")).replace(":", "-")
            if not blob.is_file():
                return None
            parts = manifest.relative_to(manifests).parts  # registry, namespace, model, tag
            model, tag = parts[-2], parts[-1]
            namespace = parts[-3] if len(parts) >= 3 else "library"
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
            return LocalModel(str(blob), name, "Ollama", blob.stat().st_size)
    return None


def ollama_name(blob: Path) -> str | None:
    """The `model:tag` whose manifest names this blob (Ollama's store: models/blobs/sha256-...)."""
    root = blob.parent.parent
    if blob.parent.name != "blobs" or not (root / "manifests").is_dir():
        return None
    for manifest in sorted(p for p in (root / "manifests").rglob("*") if p.is_file()):
        model = _ollama_model(root, root / "manifests", manifest)
        if model is not None and Path(model.source) == blob:
            return model.name
    return None


def app_models() -> list[LocalModel]:
    """Every model the other apps' stores hold: LM Studio's, GPT4All's, Ollama's."""
    return lmstudio_models() + gpt4all_models() + ollama_models()
