"""Running the server: the engine loaded first, then uvicorn on a socket of our own.

Loopback by default. Binding any other address exposes the engine to whoever can reach it, so
it needs an API key (clients send `Authorization: Bearer KEY`); without one the server refuses
to start. CORS is off unless origins are named. `BackgroundServer` runs the same thing on a
thread (the tests, the fuzz run and the benchmarks).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import TYPE_CHECKING

from engine.config import ConfigError, EngineConfig
from engine.serve.bridge import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, EngineBridge

if TYPE_CHECKING:
    import uvicorn

    from engine.model.loaded import LoadedModel

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that resolves who knows where


def check_bind(host: str, api_key: str | None) -> None:
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key must not be empty")
    if not is_loopback(host) and api_key is None:
        raise ConfigError(
            f"refusing to listen on {host} without --api-key: anyone who can reach it could use the "
            "engine. Give --api-key KEY (clients then send 'Authorization: Bearer KEY'), or bind 127.0.0.1."
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: a free one). A clear error when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def make_uvicorn(
    bridge: EngineBridge,
    api_key: str | None,
    log_level: str = "warning",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cors_origins: tuple[str, ...] = (),
) -> uvicorn.Server:
    # uvicorn and fastapi (the app): imported when a server is made, so the CLI checks its
    # arguments and the bind address (this module's other helpers) before paying for them.
    import uvicorn

    from engine.serve.app import build_app

    config = uvicorn.Config(
        build_app(bridge, api_key, max_body_bytes, cors_origins),
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
        # One event loop thread: all the work is on the engine thread, HTTP only translates.
        loop="asyncio",
        http="h11",
    )
    return uvicorn.Server(config)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class BackgroundServer:
    """The server on a thread, on a free loopback port unless told otherwise."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        api_key: str | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        model_name: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_waiting: int = DEFAULT_MAX_WAITING,
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        check_bind(host, api_key)
        self.bridge = EngineBridge(config, loaded=loaded, model_name=model_name, max_waiting=max_waiting)
        self.api_key = api_key
        self.max_body_bytes, self.cors_origins = max_body_bytes, cors_origins
        self._host, self._port = host, port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self.bridge.start(timeout)
        sock = bind(self._host, self._port)
        self.url = url_of(sock)
        server = self._server = make_uvicorn(
            self.bridge, self.api_key, max_body_bytes=self.max_body_bytes, cors_origins=self.cors_origins
        )
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="kvscope-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.bridge.shutdown()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
