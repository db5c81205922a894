"""A request the server refuses, with the status, the parameter and the code OpenAI's error
object names (engine.serve.app answers it in that shape)."""

from __future__ import annotations


class ServeError(ValueError):
    """A request the server refuses before the engine sees it; `code`/`param` as OpenAI names them."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
