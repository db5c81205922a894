"""kvscope's cache directory, and publishing converted folders into it safely between processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from platformdirs import user_cache_dir

from engine.errors import ModelLoadError
from engine.private import private_dir

# Written last into a converted folder: names the source file it came from, so a changed GGUF
# (new wheel) re-converts and a half-written folder never counts as converted.
SOURCE_MARKER = "kvscope-source.txt"


# ---- where things live -----------------------------------------------------------------------
def cache_root() -> Path:
    """kvscope's cache dir: $KVSCOPE_CACHE_DIR if set (tests, portable installs), else the
    platform's user cache dir."""
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override).expanduser()

    return Path(user_cache_dir("kvscope"))


def writable_cache_dir(folder: Path) -> Path:
    """`folder` (inside the cache) created (private: 0700), or a ModelLoadError saying which folder
    cannot be written and how to choose another: a read-only home must not end in a traceback."""
    try:
        private_dir(folder)
    except OSError as exc:
        raise _unwritable(folder, exc) from exc
    return folder


def _unwritable(folder: Path, exc: OSError) -> ModelLoadError:
    reason = exc.strerror or type(exc).__name__
    return ModelLoadError(
        f"kvscope cannot write its cache folder {folder} ({reason}), where it keeps the converted "
        "files of the default model. Make it writable, or set KVSCOPE_CACHE_DIR to a folder you can write."
    )


def source_fingerprint(path: Path) -> str:
    """Identifies one version of a source file cheaply (no hashing of hundreds of MB)."""
    st = path.stat()
    return f"{path.resolve()}\nsize={st.st_size}\nmtime_ns={st.st_mtime_ns}\n"


def is_converted(folder: Path, fingerprint: str) -> bool:
    marker = folder / SOURCE_MARKER
    return marker.is_file() and marker.read_text() == fingerprint


def publish_atomically(folder: Path, fingerprint: str, write: Callable[[Path], object]) -> Path:
    """Run `write(tmp_dir)` into a fresh temp folder beside `folder`, stamp it with the source
    marker, then swap it into place with a rename. A conversion killed half-way leaves only a
    temp folder (never a folder that looks converted); a stale folder is replaced whole."""
    writable_cache_dir(folder.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    except OSError as exc:
        raise _unwritable(folder.parent, exc) from exc
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


# ---- the packaged default, converted once ----------------------------------------------------
@contextlib.contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Serialize conversions between processes (two test runs, the app and the CLI): the second
    waits, then finds the folder already converted. No-op where fcntl is missing (Windows)."""
    root = writable_cache_dir(cache_root())
    try:
        # fcntl: POSIX only; where it is missing (Windows) the lock is a no-op
        import fcntl
    except ImportError:
        yield
        return
    try:
        lock = open(root / f".{name}.lock", "w")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise _unwritable(root, exc) from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
