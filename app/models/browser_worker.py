"""The model browser's Hub calls (engine.hub: search, files, download) as the app's workers
(app.workers.create_worker): the call runs on a thread of its own, and its progress and outcome
reach the browser on the GUI thread, where this object emits its signals. No Hub thread ever
touches Qt, so a browser closed while a call still runs is never signalled from that thread.

Each call gets a ticket; a result for a ticket the browser no longer waits for (the user typed a
new search, chose another repo) is dropped. A download reports its bytes at most every 100 ms,
and `cancel()` stops it between two chunks (what arrived stays in the cache for a resume).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.workers import Channel, UserFacingError, Worker, create_worker

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
        self._jobs: list[Worker] = []
        self._cancel: threading.Event | None = None

    def _start(self, what: str, fn: Callable[[Channel], Any], done: Signal) -> int:
        self._ticket += 1
        ticket = self._ticket

        def run(channel: Channel) -> Any:
            from engine.api import HubError

            try:
                return fn(channel)
            except HubError as exc:  # written for the user: shown as it is
                raise UserFacingError(str(exc)) from exc

        job = create_worker(
            run,
            name=f"kvscope-hub-{what}",
            progress=True,
            parent=self,
            on_progress=lambda payload: self.progressed.emit(ticket, payload),
            on_returned=lambda result: done.emit(ticket, result),
            on_errored=lambda message: self.failed.emit(ticket, what, message),
        )
        self._jobs = [j for j in self._jobs if j.running] + [job]
        return ticket

    def search(self, query: str, sort: str = "downloads", limit: int = 30) -> int:
        from engine.api import search_models

        return self._start("search", lambda _: search_models(query, limit=limit, sort=sort), self.searched)

    def files(self, repo_id: str, dtype: str, context: int) -> int:
        from engine.api import repo_files

        return self._start("files", lambda _: repo_files(repo_id, dtype=dtype, context=context), self.listed)

    def download(self, repo_id: str, files: tuple[str, ...]) -> int:
        from engine.api import download_files

        cancel = self._cancel = threading.Event()

        def fetch(channel: Channel) -> Any:
            last = 0.0

            def report(progress: Any) -> None:
                nonlocal last
                now = time.monotonic()
                if now - last >= PROGRESS_INTERVAL_S or progress.done_bytes >= progress.total_bytes:
                    last = now
                    channel.post("progress", progress)  # to the GUI thread, as the job's progress

            return download_files(repo_id, files, progress=report, cancel=cancel)

        return self._start("download", fetch, self.downloaded)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def wait(self, timeout: float = 10.0) -> None:
        """Join the calls in flight and deliver their news now (window close, tests): no thread
        outlives the browser."""
        self.cancel()
        for job in self._jobs:
            job.wait(timeout)
            if job.running:
                job.drain()
