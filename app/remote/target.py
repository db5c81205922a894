"""Where the app attaches: a server's base URL and optional API key, and what it turned out to be."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

# How each known server's Prometheus metrics are prefixed (kvscope uses vLLM's names under its own).
FAMILIES = ("kvscope", "vllm", "sglang", "llamacpp")
FAMILY_NAMES = {
    "kvscope": "kvscope",
    "vllm": "vLLM",
    "sglang": "SGLang",
    "llamacpp": "llama.cpp",
    "": "unknown server",
}


class TargetError(ValueError):
    """A URL the app cannot attach to; the message says why."""


@dataclass(frozen=True, slots=True)
class RemoteTarget:
    url: str  # base URL without a trailing "/v1": http://host:port[/prefix]
    api_key: str | None = None

    @staticmethod
    def parse(text: str, api_key: str | None = None) -> RemoteTarget:
        raw = text.strip()
        if not raw:
            raise TargetError("enter the server's URL, e.g. http://127.0.0.1:8000")
        if "://" not in raw:
            raw = "http://" + raw
        parts = urlsplit(raw)
        if parts.scheme not in ("http", "https"):
            raise TargetError(f"the URL must start with http:// or https://, not {parts.scheme}://")
        if not parts.hostname:
            raise TargetError(f"no host in {text.strip()!r}")
        try:
            parts.port  # noqa: B018 - raises for a port out of range
        except ValueError as exc:
            raise TargetError(f"bad port in {text.strip()!r}: {exc}") from exc
        path = parts.path.rstrip("/")
        path = path.removesuffix("/v1")
        key = api_key.strip() if api_key else None
        return RemoteTarget(f"{parts.scheme}://{parts.netloc}{path}", key or None)

    @property
    def label(self) -> str:
        """host:port, how the app names the server beside the model."""
        parts = urlsplit(self.url)
        return parts.netloc + parts.path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """What the app attached to, once it answered: the app-side record of a remote engine."""

    target: RemoteTarget
    model: str  # the model id the server serves (from /v1/models)
    family: str  # "kvscope", "vllm", "sglang", "llamacpp" (from its /metrics), or "" if unknown
    events: bool  # it streams kvscope engine events: every panel works as with a local engine
    metrics: bool  # it answers /metrics
    t: float = 0.0

    @property
    def server_name(self) -> str:
        return FAMILY_NAMES.get(self.family, self.family)

    @property
    def model_name(self) -> str:
        """The served model's id, or the file's name when a server names it by its path (llama.cpp
        does); a repo id like org/model stays whole."""
        path = self.model.replace("\\", "/")
        if not (path.startswith(("/", "~", "./")) or path.endswith(".gguf") or ":/" in path):
            return self.model
        return path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf") or self.model

    @property
    def display_name(self) -> str:
        """The model with the server named: what conversations store as the reply's model."""
        return f"{self.model_name} @ {self.target.label} ({self.server_name})"
