"""Downloading a repo's chosen files into the standard HF cache, byte by byte, cancellable, resumable.

huggingface_hub's own bar for a repo counts files; kvscope wants bytes over the whole choice. And
`hf_hub_download` resumes only within one call (a dropped connection is retried with a Range
request), then deletes its partial file, so a cancel or a failure would start over. So each
file's blob is fetched here, with huggingface_hub's `http_get` (Range resume, retries, its auth
headers) into `blobs/<etag>.incomplete`, which stays when the download stops and is resumed by the
next one; once complete it becomes `blobs/<etag>` and `hf_hub_download` (finding the blob) makes
the snapshot link and the ref, so the cache is exactly what huggingface_hub itself would leave.
Each file's byte bar reports into a tally of the whole choice; cancelling raises from it. Before
anything is fetched the free disk space is checked against what is left to download.

Everything is fetched at the commit the listing named (`model_info(...).sha`), never at `main`:
a repo whose `main` moves during the download would otherwise mix two versions' files in one
snapshot. `refs/main` is then set to that commit, as huggingface_hub does after a download of
`main`, so a later load by repo id (offline) finds this snapshot.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.hub.online import HubError, api, endpoint, hub_call, token
from engine.private import open_private_append, private_dir


class DownloadCancelled(HubError):
    """The user stopped the download; what arrived is kept for a resume."""


@dataclass(frozen=True, slots=True)
class DownloadProgress:
    done_bytes: int  # of the whole choice, resumed bytes included
    total_bytes: int
    file: str  # the file arriving now
    files_done: int
    files_total: int
    bytes_per_s: float  # this session's rate (resumed bytes excluded)


@dataclass(frozen=True, slots=True)
class DownloadResult:
    repo_id: str
    revision: str
    folder: Path  # the snapshot folder in the HF cache
    files: tuple[str, ...]
    downloaded_bytes: int  # fetched in this call (0 when all was cached)
    resumed_bytes: int  # already there as partial files
    total_bytes: int
    cached_bytes: int = 0  # files already complete in the cache: downloaded + resumed + cached = total

    @property
    def source(self) -> str:
        """What to load: the repo id (safetensors), or the GGUF file's path."""
        ggufs = [f for f in self.files if f.lower().endswith(".gguf")]
        return str(self.folder / ggufs[0]) if len(ggufs) == 1 else self.repo_id


class _Tally:
    """Byte counts of one download across its files; the per-file bars report into it."""

    def __init__(
        self,
        total: int,
        files_total: int,
        report: Callable[[DownloadProgress], None],
        cancel: threading.Event | None,
    ):
        self.total, self.files_total = total, files_total
        self.report, self.cancel = report, cancel
        self.done_before = 0  # bytes of files finished (or found complete) before the current one
        self.current = 0  # bytes of the current file, its resumed part included
        self.resumed = 0
        self.fetched = 0
        self.files_done = 0
        self.file = ""
        self.started = time.monotonic()

    def emit(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        self.report(
            DownloadProgress(
                self.done_before + self.current,
                self.total,
                self.file,
                self.files_done,
                self.files_total,
                self.fetched / elapsed,
            )
        )

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled(
                "Download cancelled: the files that arrived are kept in the Hugging Face cache and the "
                "next download of this model resumes where it stopped."
            )

    def bar(self, total: int | None = None, initial: int | None = 0, **_ignored: Any) -> _FileBar:
        """The progress bar huggingface_hub opens for one file (its tqdm_class)."""
        return _FileBar(self, initial or 0)


class _FileBar:
    def __init__(self, tally: _Tally, initial: int):
        self.tally = tally
        tally.current = initial
        tally.resumed += initial
        tally.emit()

    def update(self, n: int = 1) -> None:
        # huggingface_hub counts a chunk before writing it: stop here and the chunks before it
        # are on disk, this one is not (so it is not counted either)
        self.tally.check_cancel()
        self.tally.current += n
        self.tally.fetched += max(n, 0)
        self.tally.emit()

    def update_transfer(self, n: int) -> None:  # the Hub's own bars count transfers apart
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _repo_dir(repo_id: str) -> Path:
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def private_repo_dir(repo_id: str) -> Path:
    """The repo's folder in the HF cache, created 0700 when missing (what lands in it is the
    user's alone; an existing folder keeps its permissions)."""
    return private_dir(_repo_dir(repo_id))


@dataclass(frozen=True, slots=True)
class _Plan:
    name: str
    url: str  # where the bytes are (the Hub's redirect target for large files)
    etag: str
    size: int

    def blob(self, repo_id: str) -> Path:
        return _repo_dir(repo_id) / "blobs" / self.etag

    def partial(self, repo_id: str) -> Path:
        return _repo_dir(repo_id) / "blobs" / f"{self.etag}.incomplete"


def _plan(repo_id: str, name: str, revision: str) -> _Plan:
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    meta = get_hf_file_metadata(
        hf_hub_url(repo_id, name, revision=revision, endpoint=endpoint()), token=token()
    )
    if not meta.etag:
        raise HubError(f"The Hub gave no version tag (ETag) for {name} of {repo_id}; it cannot be cached.")
    return _Plan(name, meta.location, meta.etag, int(meta.size or 0))


def _fetch_blob(repo_id: str, plan: _Plan, tally: _Tally) -> None:
    """The file's bytes into blobs/<etag>, resuming blobs/<etag>.incomplete."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub.utils import WeakFileLock

    blob, partial = plan.blob(repo_id), plan.partial(repo_id)
    if blob.exists():
        return
    private_dir(blob.parent)  # the repo's folder too, when this download creates it: 0700
    lock = _repo_dir(repo_id).parent / ".locks" / _repo_dir(repo_id).name / f"{plan.etag}.lock"
    private_dir(lock.parent)
    with WeakFileLock(str(lock)):
        resume = partial.stat().st_size if partial.exists() else 0
        if plan.size and resume > plan.size:  # not this file's bytes: start over
            partial.unlink()
            resume = 0
        _get(plan, partial, resume, tally)
        if resume and not _matches(plan, partial):
            # the part kept from before was not this file's (a crash mid-write, another version):
            # the whole file again rather than a corrupt model
            partial.unlink()
            tally.resumed -= resume
            _get(plan, partial, 0, tally)
            if not _matches(plan, partial):
                partial.unlink()
                raise HubError(
                    f"{plan.name} arrived with the wrong content (its SHA-256 differs); try again."
                )
        partial.replace(blob)


# huggingface_hub reads the body 10 MiB at a time: a bar that moves every 10 s on a 1 MB/s line.
PROGRESS_CHUNK = 1 << 20


def _get(plan: _Plan, partial: Path, resume: int, tally: _Tally) -> None:
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import constants
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, PROGRESS_CHUNK)
    with open(open_private_append(partial), "ab") as f:  # a new part is 0600
        http_get(
            plan.url,
            f,
            resume_size=resume,
            headers=build_hf_headers(token=token()),
            expected_size=plan.size or None,
            # huggingface_hub only calls its tqdm_class and uses the bar's update/close/context;
            # its annotation asks for a tqdm subclass, a factory of _FileBar does the same
            tqdm_class=tally.bar,  # type: ignore[arg-type]
        )


def _matches(plan: _Plan, path: Path) -> bool:
    """The file's SHA-256 is the Hub's ETag for LFS files (weights): check it after a resume.
    Small (git) files carry another kind of ETag; their size was checked by http_get."""
    if not re.fullmatch(r"[0-9a-f]{64}", plan.etag):
        return True
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == plan.etag


def download_files(
    repo_id: str,
    files: list[str] | tuple[str, ...],
    progress: Callable[[DownloadProgress], None] | None = None,
    cancel: threading.Event | None = None,
) -> DownloadResult:
    """Fetch `files` of `repo_id` (at its current revision) into the HF cache."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import constants, hf_hub_download

    if not files:
        raise HubError("Choose at least one file to download.")
    report = progress or (lambda p: None)
    with hub_call(repo_id):
        info = api().model_info(repo_id, files_metadata=True)
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
        missing = [f for f in files if f not in sizes]
        if missing:
            raise HubError(f"{repo_id} has no file {missing[0]} on the Hub.")
        revision = info.sha
        if revision is None:
            raise HubError(f"The Hub did not say which commit of {repo_id} it listed; try again.")
        private_repo_dir(repo_id)
        plans = [_plan(repo_id, name, revision) for name in files]
        total = sum(p.size for p in plans)
        left = 0
        for p in plans:
            if not p.blob(repo_id).exists():
                partial = p.partial(repo_id)
                left += p.size - (partial.stat().st_size if partial.exists() else 0)
        cache = Path(constants.HF_HUB_CACHE)
        private_dir(cache)
        free = shutil.disk_usage(cache).free
        if left > free:
            raise HubError(
                f"Not enough disk space: {repo_id} needs {_gib(left)} more in {cache}, but only {_gib(free)} "
                "is free. Free some space (`models delete` removes cached models) and try again."
            )
        tally = _Tally(total, len(files), report, cancel)
        cached = sum(p.size for p in plans if p.blob(repo_id).exists())
        for plan in plans:
            tally.check_cancel()
            tally.file, tally.current = plan.name, 0
            _fetch_blob(repo_id, plan, tally)
            # the blob is in place: huggingface_hub links it into the planned commit's snapshot
            hf_hub_download(repo_id, plan.name, revision=revision, endpoint=endpoint(), token=token())
            tally.done_before += plan.size
            tally.current = 0
            tally.files_done += 1
            tally.emit()
        _point_main_at(repo_id, revision)
    folder = _repo_dir(repo_id) / "snapshots" / revision
    return DownloadResult(
        repo_id, revision, folder, tuple(files), tally.fetched, tally.resumed, total, cached
    )


def _point_main_at(repo_id: str, revision: str) -> None:
    """refs/main -> the commit just downloaded (what `main` was when the download was planned)."""
    ref = _repo_dir(repo_id) / "refs" / "main"
    private_dir(ref.parent)
    tmp = ref.with_name(f".main.{threading.get_ident()}.tmp")
    tmp.write_text(revision)
    tmp.replace(ref)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
