"""Helpers of the server tests: chat messages, the engine's pool, the events stream on a thread."""

from __future__ import annotations

import threading
import time

import httpx

from engine.serve import codec

MODEL = "tiny-random-llama"


def chat(user: str = "Hello there", system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def pool_used(server) -> int:
    return server.bridge.engine._call(lambda core: core.kv.pool.num_used).result(10)


def wait_for(predicate, timeout: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class EventsListener:
    """/v1/kvscope/events read on a thread, decoded into engine events."""

    def __init__(self, url: str, headers: dict | None = None):
        self.url, self.headers = url, headers or {}
        self.hello: dict | None = None
        self.events: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._response = None

    def __enter__(self):
        self._thread.start()
        wait_for(lambda: self.hello is not None, what="the events stream's hello")
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._response is not None:
            self._response.close()
        self._thread.join(10)

    def _run(self):
        import json

        with (
            httpx.Client(timeout=None) as http,
            http.stream("GET", self.url + "/v1/kvscope/events", headers=self.headers) as r,
        ):
            self._response = r
            event = None
            try:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        if event == "hello":
                            self.hello = json.loads(line[6:])
                        elif event == "events":
                            decoded = codec.decode(line[6:])
                            with self._lock:
                                self.events.extend(decoded)
            except httpx.HTTPError:
                return

    def of(self, kind) -> list:
        with self._lock:
            return [e for e in self.events if isinstance(e, kind)]

    def all(self) -> list:
        with self._lock:
            return list(self.events)
