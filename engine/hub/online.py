"""Reaching the Hugging Face Hub: only on the user's explicit request, with one-line failures.

kvscope loads models from local files only (every transformers call passes local_files_only),
and its entry points switch huggingface_hub offline by default so that nothing downloads behind
the user's back (`offline_by_default`). The Hub package (search, files, download) goes online
for the one call the user asked for, unless the user set HF_HUB_OFFLINE themselves: then it says
so in one line. The endpoint (HF_ENDPOINT) and token (HF_TOKEN, or the token file huggingface_hub
keeps after `hf auth login`) are read at call time, so tests and users can point them anywhere.
"""

from __future__ import annotations

import errno
import os
import socket
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # huggingface_hub is imported at call time, after the offline switch
    from huggingface_hub import HfApi

DEFAULT_ENDPOINT = "https://huggingface.co"
# Set by offline_by_default: HF_HUB_OFFLINE=1 is kvscope's default, not the user's wish.
OFFLINE_IS_DEFAULT = "KVSCOPE_HF_OFFLINE_IS_DEFAULT"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class HubError(Exception):
    """A Hub operation failed; str() is one line for the user."""


def offline_by_default() -> None:
    """Before anything imports huggingface_hub or transformers: offline unless the user said
    otherwise, and remember that the choice was kvscope's (so the Hub package may go online)."""
    if not any(name in os.environ for name in _OFFLINE_VARS):
        for name in _OFFLINE_VARS:
            os.environ[name] = "1"
        os.environ[OFFLINE_IS_DEFAULT] = "1"


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def user_wants_offline() -> bool:
    if os.environ.get(OFFLINE_IS_DEFAULT):
        return False
    return any(_true(os.environ.get(name)) for name in _OFFLINE_VARS)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> str | None:
    """HF_TOKEN, else the token file `hf auth login` writes; None when neither."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import get_token

    return get_token()


def api() -> HfApi:
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token())


OFFLINE_MESSAGE = (
    "Offline: HF_HUB_OFFLINE is set, so kvscope does not contact the Hugging Face Hub. "
    "Unset it to search and download; models already on this machine still load."
)


def go_online() -> None:
    """Let huggingface_hub make requests (it checks its offline flag on every one)."""
    if user_wants_offline():
        raise HubError(OFFLINE_MESSAGE)
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = False


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def describe(exc: BaseException, repo_id: str | None = None) -> str:
    """The one line a Hub failure shows the user."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    import httpx2 as httpx
    from huggingface_hub import errors

    what = repo_id or "the repository"
    has_token = token() is not None
    if isinstance(exc, HubError):
        return str(exc)
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return OFFLINE_MESSAGE
    if isinstance(exc, errors.GatedRepoError):
        if has_token:
            return (
                f"{what} is gated and your Hugging Face token has no access to it: accept its licence on "
                f"its Hub page with that account, then try again."
            )
        return (
            f"{what} is gated: accept its licence on its Hub page, then set HF_TOKEN (or run "
            "`hf auth login`) so kvscope can download it."
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        private = "" if has_token else " If it is private, set HF_TOKEN (or run `hf auth login`)."
        return f"{what} was not found on the Hub.{private}"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{what} has no such revision on the Hub."
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"{what} has no such file on the Hub."
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return (
            "The disk is full: the download stopped. The partial file is kept and resumes where it "
            "stopped once there is space (or remove it with `models delete`)."
        )
    cause: BaseException | None = exc
    while cause is not None and not isinstance(
        cause, (httpx.TransportError, ConnectionError, TimeoutError, socket.gaierror)
    ):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return (
            f"Cannot reach the Hugging Face Hub at {endpoint()} (no network?): {_first_line(cause)}. "
            "A partly downloaded file resumes next time."
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        return f"The Hugging Face Hub refused the request (HTTP {status}): {_first_line(exc)}"
    return f"The Hugging Face Hub request failed ({type(exc).__name__}: {_first_line(exc)})"


_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
CONNECT_TIMEOUT_S = 5.0


def _connect_once() -> None:
    """One TCP connect to the endpoint, no retries: a machine without a network is told at once.
    huggingface_hub retries a refused or unresolvable connection five times with backoff (1, 2,
    4, 8, 8 s: 23 s measured before the Hub browser's search said anything). Retries stay for
    what happens after a connection was made (a download dropped mid-file). Skipped behind a
    proxy, which is what the client connects to."""
    if any(os.environ.get(name) for name in _PROXY_VARS):
        return
    url = urllib.parse.urlsplit(endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    with socket.create_connection((url.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
        pass


@contextmanager
def hub_call(repo_id: str | None = None) -> Iterator[None]:
    """Go online for this call; any failure becomes a HubError with one line."""
    go_online()
    try:
        _connect_once()
        yield
    except HubError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is said in one line, never a traceback
        raise HubError(describe(exc, repo_id)) from exc
