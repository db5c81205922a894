"""What stands between the network and the routes: the API key, the body size, CORS.

Plain ASGI middlewares (Starlette's BaseHTTPMiddleware would wrap `receive` and hide a client's
disconnect from the routes). Outermost first: CORS (a browser's preflight carries no key), the
API key (nothing of an unauthenticated body is read), the body limit.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.serve.protocol import ERROR_TYPES, error_body

# The one route open without the key: a plain liveness answer for probes (no model, no figures).
OPEN_PATHS = frozenset({"/health"})


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(message, ERROR_TYPES.get(status, "invalid_request_error"), param, code), status
    )


class RequireKey:
    """`Authorization: Bearer KEY` on every route but GET /health: the OpenAI routes, /metrics
    (what the server serves and how busy it is), the events stream (every client's tokens) and
    the OpenAPI schema."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (
            scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD")
        ):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    401,
                    "Incorrect or missing API key: send Authorization: Bearer KEY.",
                    None,
                    "invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """A body past `limit` bytes is refused with 413 as soon as that is known: at once from its
    Content-Length, or when a chunked body's bytes pass the limit (the rest is never read). A
    body within it is read here whole and handed on."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self, given: int | None = None) -> JSONResponse:
        size = f" ({given} bytes)" if given is not None else ""
        return error_response(
            413,
            f"The request body{size} is larger than this server accepts ({self.limit} bytes; "
            "the operator sets it with --max-body-bytes).",
            None,
            "request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = 0
            if declared > self.limit:
                await self._too_large(declared)(scope, receive, send)
                return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large()(scope, receive, send)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body: list[Message] = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)


def install(app: FastAPI, api_key: str | None, max_body_bytes: int, cors_origins: Sequence[str]) -> None:
    """The guards on `app` (Starlette runs the last one added first). CORS is off unless origins
    are given: a browser page from elsewhere cannot read the answers."""
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
