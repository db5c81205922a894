"""The model browser's Hub calls (engine.hub: search, files, download) on short-lived worker
threads, their results carried back to the GUI thread by queued signals.

Each call gets a ticket; a result for a ticket the browser no longer waits for (the user typed a
new search, chose another repo) is dropped. A download reports its bytes at most every 100 ms,
and `cancel()` stops it between two chunks (what arrived stays in the cache for a resume).
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, Signal

PROGRESS_INTERVAL_S = 0.1


class HubWorker(QObject):
    searched = Signal(int, object)  # ticket, list[ModelHit]
    listed = Signal(int, object)  # ticket, RepoFiles
    progressed = Signal(int, object)  # ticket, DownloadProgress
    downloaded = Signal(int, object)  # ticket, DownloadResult
    failed = Signal(int, str, str)  # ticket, what ("search", "files", "download"), one-line message

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._ticket = 0
        self._threads: list[threading.Thread] = []
        self._cancel: threading.Event | None = None

    def _start(self, what: str, fn, done: Signal) -> int:
        self._ticket += 1
        ticket = self._ticket

        def run() -> None:
            from engine.hub.online import HubError

            try:
                result = fn()
            except HubError as exc:
                self.failed.emit(ticket, what, str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug must still reach the user as a line
                self.failed.emit(ticket, what, f"{type(exc).__name__}: {exc}")
            else:
                done.emit(ticket, result)

        thread = threading.Thread(target=run, name=f"kvscope-hub-{what}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return ticket

    def search(self, query: str, sort: str = "downloads", limit: int = 30) -> int:
        from engine.hub.search import search_models

        return self._start("search", lambda: search_models(query, limit=limit, sort=sort), self.searched)

    def files(self, repo_id: str, dtype: str, context: int) -> int:
        from engine.hub.files import repo_files

        return self._start("files", lambda: repo_files(repo_id, dtype=dtype, context=context), self.listed)

    def download(self, repo_id: str, files: tuple[str, ...]) -> int:
        from engine.hub.download import download_files

        cancel = self._cancel = threading.Event()
        last = [0.0]
        ticket_box = [0]

        def report(progress) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_INTERVAL_S or progress.done_bytes >= progress.total_bytes:
                last[0] = now
                self.progressed.emit(ticket_box[0], progress)

        ticket_box[0] = self._ticket + 1  # the ticket _start is about to hand out
        return self._start(
            "download",
            lambda: download_files(repo_id, files, progress=report, cancel=cancel),
            self.downloaded,
        )

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def wait(self, timeout: float = 10.0) -> None:
        """Join the calls in flight (window close, tests): no thread outlives the browser."""
        self.cancel()
        for thread in self._threads:
            thread.join(timeout)
