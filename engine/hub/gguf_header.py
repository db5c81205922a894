"""A GGUF file on the Hub: its header read over HTTP range requests (engine/model/gguf_header.py
parses it), so a repo's shapes and fit are known before any download."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.hub.online import endpoint, token
from engine.model.configs import config_from_header
from engine.model.gguf_header import GGUFHeader, GGUFHeaderError, read_header

if TYPE_CHECKING:
    from engine.model.gguf_plan import GGUFPlan

__all__ = [
    "GGUFHeader",
    "GGUFHeaderError",
    "config_from_header",
    "header_plan",
    "read_header",
    "remote_fetcher",
]


def header_plan(header: GGUFHeader, dtype: str, native: bool) -> GGUFPlan:
    """What a load of the file this header describes would hold (engine.model.gguf_plan)."""
    # torch (the plan names the kernels' storages): only for an estimate, not for reading headers
    from engine.model.gguf_plan import plan_header

    return plan_header(header, dtype, native)


def remote_fetcher(repo_id: str, filename: str, revision: str | None = None) -> Callable[[int, int], bytes]:
    """fetch(start, end) for a file on the Hub, through huggingface_hub's session and auth."""
    # huggingface_hub reads its HF_* settings when first imported: after hub.online set them
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint())
    headers = build_hf_headers(token=token())

    def fetch(start: int, end: int) -> bytes:
        response = get_session().get(
            url, headers={**headers, "Range": f"bytes={start}-{end}"}, follow_redirects=True
        )
        if response.status_code == 416:  # asked past the end
            return b""
        hf_raise_for_status(response)
        data = response.content
        if response.status_code == 200:  # the server ignored the range
            data = data[start : end + 1]
        return data

    return fetch
