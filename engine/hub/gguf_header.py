"""A GGUF file's metadata read over HTTP range requests: the model's shapes before any download.

A GGUF repo on the Hub rarely has a config.json; its shapes (layers, heads, KV heads, head size,
vocabulary) live in the file's header, before the tensors. This reads the header a megabyte at a
time (the tokenizer's token list, a few MB, is walked through but not kept) and builds the
config transformers would, with engine.model.configs.gguf_metadata_config.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.hub.online import endpoint, token
from engine.model.configs import gguf_metadata_config

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from engine.model.gguf_plan import GGUFPlan

CHUNK = 1 << 20
MAX_HEADER_BYTES = 64 << 20  # a header past this is not one kvscope can use

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF header kvscope can read."""


class _Stream:
    """Sequential reads over `fetch(start, end_inclusive) -> bytes`, one CHUNK at a time."""

    def __init__(self, fetch: Callable[[int, int], bytes]):
        self.fetch = fetch
        self.buf = b""
        self.start = 0  # file offset of buf[0]
        self.pos = 0

    def read(self, n: int) -> bytes:
        end = self.pos + n
        if end > MAX_HEADER_BYTES:
            raise GGUFHeaderError("the GGUF header is larger than kvscope reads")
        while end > self.start + len(self.buf):
            have = self.start + len(self.buf)
            more = self.fetch(have, have + max(CHUNK, end - have) - 1)
            if not more:
                raise GGUFHeaderError("the file ends inside its GGUF header")
            self.buf = self.buf[self.pos - self.start :] + more
            self.start = self.pos
        out = self.buf[self.pos - self.start : end - self.start]
        self.pos = end
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.read(self.unpack("<Q"))


def _value(s: _Stream, kind: int, keep_strings: bool) -> Any:
    """A metadata value as decoded: a number, a string, a list of them, or _Skipped."""
    if kind in _SCALARS:
        return s.unpack(_SCALARS[kind])
    if kind == _STRING:
        return s.string()
    if kind == _ARRAY:
        item, count = s.unpack("<I"), s.unpack("<Q")
        if item == _STRING and not keep_strings:
            for _ in range(count):
                s.skip_string()
            return _Skipped(count)
        if item in _SCALARS and count > 4096:  # a big numeric table (token scores): skip it
            s.read(count * struct.calcsize(_SCALARS[item]))
            return _Skipped(count)
        return [_value(s, item, keep_strings) for _ in range(count)]
    raise GGUFHeaderError(f"unknown GGUF value type {kind}")


class _Skipped:
    """An array walked over but not kept (the token list): only its length."""

    def __init__(self, count: int):
        self.count = count


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, Any]  # metadata key -> value (the token list only as its length)
    tensor_types: dict[str, int]  # tensor name -> GGML type id
    params: int  # elements over all tensors, the model's parameter count
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name -> dims, innermost first

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(self.tensor_types)


def read_header(fetch: Callable[[int, int], bytes]) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file reachable through `fetch`."""
    s = _Stream(fetch)
    if s.read(4) != b"GGUF":
        raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
    version = s.unpack("<I")
    if version < 2:
        raise GGUFHeaderError(f"GGUF version {version} is too old")
    n_tensors, n_kv = s.unpack("<Q"), s.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = s.string()
        fields[key] = _value(s, s.unpack("<I"), keep_strings=not key.startswith("tokenizer."))
    types: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    params = 0
    for _ in range(n_tensors):
        name = s.string()
        dims = tuple(s.unpack("<Q") for _ in range(s.unpack("<I")))
        count = 1
        for d in dims:
            count *= d
        params += count
        types[name] = s.unpack("<I")
        shapes[name] = dims
        s.read(8)  # offset
    return GGUFHeader(fields, types, params, shapes)


def header_plan(header: GGUFHeader, dtype: str, native: bool) -> GGUFPlan:
    """What a load of the file this header describes would hold (engine.model.gguf_plan)."""
    # torch (the plan names the kernels' storages): only for an estimate, not for reading headers
    from engine.model.gguf_plan import entry_from_gguf, plan_entries

    entries = [
        entry_from_gguf(name, header.tensor_types[name], dims) for name, dims in header.tensor_shapes.items()
    ]
    return plan_entries(entries, dtype, native)


def config_from_header(header: GGUFHeader, name: str) -> PreTrainedConfig:
    """The transformers config of a GGUF header (a ModelLoadError when it describes none)."""

    fields = header.fields
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = tokens.count if isinstance(tokens, _Skipped) else (len(tokens) if tokens else None)

    def value_of(key: str) -> Any:
        value = fields.get(key)
        return None if isinstance(value, _Skipped) else value

    return gguf_metadata_config(value_of, set(header.tensor_names), vocab, name)


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
