"""The local Hugging Face cache: which models it holds, their size on disk, and deleting one; and
every model on this machine (the cache's, then the other apps' stores of engine.model.local_models).

Read with huggingface_hub's `scan_cache_dir` (the same view as `hf cache scan`); partial
downloads (`blobs/<etag>.incomplete`, see engine/hub/download.py) are counted apart, because they
are what a later download resumes. Needs no network.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.hub.online import HubError
from engine.model.configs import causal_lm_problem
from engine.model.local_models import LocalModel, app_models
from engine.model.sources import hf_cache_dir

if TYPE_CHECKING:
    from huggingface_hub import HFCacheInfo


@dataclass(frozen=True, slots=True)
class CachedModel:
    repo_id: str
    size_bytes: int  # complete files on disk
    partial_bytes: int  # unfinished downloads, resumable
    files: int
    revisions: tuple[str, ...]  # commit hashes (short)
    last_modified: float  # seconds since the epoch
    path: str  # the repo's folder in the cache
    weights: tuple[str, ...]  # "safetensors", "gguf"
    source: str  # what to load: the repo id, or the path of its only GGUF

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scan() -> HFCacheInfo | None:
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(hf_cache_dir())
    except CacheNotFound:
        return None
    except OSError as exc:
        raise HubError(f"The Hugging Face cache at {hf_cache_dir()} cannot be read: {exc}") from None


def _partial_bytes(repo_path: Path) -> int:
    return sum(p.stat().st_size for p in (repo_path / "blobs").glob("*.incomplete"))


def _only_partial(known: set[str]) -> list[CachedModel]:
    """Repos whose first download was stopped before any file completed (a kill -9, a crash):
    huggingface_hub's scan skips them (no snapshot yet), but their parts are what the next
    download resumes, so they are listed, with no complete file."""
    out = []
    root = hf_cache_dir()
    for folder in sorted(root.glob("models--*")) if root.is_dir() else []:
        repo_id = folder.name.removeprefix("models--").replace("--", "/")
        partial = _partial_bytes(folder) if (folder / "blobs").is_dir() else 0
        if repo_id in known or not partial:
            continue
        mtime = max((p.stat().st_mtime for p in (folder / "blobs").iterdir()), default=0.0)
        out.append(CachedModel(repo_id, 0, partial, 0, (), mtime, str(folder), (), repo_id))
    return out


def list_cached() -> list[CachedModel]:
    """Model repos in the HF cache (and repos with only a stopped download's parts), largest
    first."""
    scan = _scan()
    if scan is None:
        return _only_partial(set())
    out = []
    for repo in scan.repos:
        if repo.repo_type != "model":
            continue
        names = {f.file_name: f for rev in repo.revisions for f in rev.files}
        ggufs = sorted({str(f.file_path) for f in names.values() if f.file_name.lower().endswith(".gguf")})
        weights = tuple(
            kind
            for kind, present in (
                ("safetensors", any(n.endswith(".safetensors") for n in names)),
                ("gguf", bool(ggufs)),
            )
            if present
        )
        has_folder = "config.json" in names and "safetensors" in weights
        source = repo.repo_id if has_folder or len(ggufs) != 1 else ggufs[0]
        out.append(
            CachedModel(
                repo_id=repo.repo_id,
                size_bytes=repo.size_on_disk,
                partial_bytes=_partial_bytes(Path(repo.repo_path)),
                files=repo.nb_files,
                revisions=tuple(sorted(rev.commit_hash[:12] for rev in repo.revisions)),
                last_modified=float(repo.last_modified or 0.0),
                path=str(repo.repo_path),
                weights=weights,
                source=source,
            )
        )
    out += _only_partial({m.repo_id for m in out})
    return sorted(out, key=lambda m: (m.size_bytes, m.partial_bytes), reverse=True)


def delete_cached(repo_id: str) -> int:
    """Remove every revision of `repo_id` (and its partial downloads) from the cache; the bytes freed."""
    scan = _scan()
    repo = next(
        (r for r in (scan.repos if scan else ()) if r.repo_id == repo_id and r.repo_type == "model"), None
    )
    if repo is None:
        raise HubError(
            f"{repo_id} is not in the Hugging Face cache at {hf_cache_dir()}; `models list` shows what is."
        )
    repo_path = Path(repo.repo_path)
    freed = _partial_bytes(repo_path)
    if repo.revisions:
        assert scan is not None, "the repo was found in the scan"
        strategy = scan.delete_revisions(*(rev.commit_hash for rev in repo.revisions))
        freed += strategy.expected_freed_size
        strategy.execute()
    if repo_path.exists():  # what the strategy leaves: partial blobs, empty folders, refs
        shutil.rmtree(repo_path, ignore_errors=True)
    return freed


def cached_source(repo_id: str, revision: str, files: tuple[str, ...]) -> str | None:
    """What to load when every one of `files` is complete in the cache at `revision` (the repo id,
    or the path of its one GGUF file, as a finished download names it), else None. Reads the
    cache's links only, no network."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import try_to_load_from_cache

    paths = []
    for name in files:
        found = try_to_load_from_cache(repo_id, name, cache_dir=hf_cache_dir(), revision=revision)
        if not isinstance(found, str):  # None (not there) or the "known missing" marker
            return None
        paths.append(found)
    ggufs = [p for p in paths if p.lower().endswith(".gguf")]
    return ggufs[0] if len(ggufs) == 1 else repo_id


# ---- models on this machine ---------------------------------------------------------------------
def hf_cache_models() -> list[LocalModel]:
    """The cache's repos that load as a text model (a config and safetensors), and its GGUF files."""
    try:
        cached = list_cached()
    except Exception:  # noqa: BLE001 - an unreadable cache lists nothing rather than failing the picker
        return []
    out = []
    for repo in cached:
        if "safetensors" in repo.weights and repo.source == repo.repo_id and _generates_text(Path(repo.path)):
            out.append(LocalModel(repo.repo_id, repo.repo_id, "HF cache", repo.size_bytes))
        for path in sorted(Path(repo.path).glob("snapshots/*/**/*.gguf")):
            out.append(LocalModel(str(path), f"{repo.repo_id}/{path.name}", "HF cache", path.stat().st_size))
    return out


def _generates_text(repo_path: Path) -> bool:
    """The repo's config.json describes a causal LM transformers can load (not BERT, not ViT...)."""
    for config in sorted(repo_path.glob("snapshots/*/config.json")):
        try:
            raw = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and causal_lm_problem(raw) is None:
            return True
    return False


def find_local_models() -> list[LocalModel]:
    """Every model found on this machine, HF cache first."""
    return hf_cache_models() + app_models()
