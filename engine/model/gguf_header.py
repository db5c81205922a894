"""A GGUF file's header, read lean: its metadata and tensor table, the tokenizer's token list
walked through but not kept.

Used for a local file (the native loader's config and tensor table: gguf-py's reader builds every
field as Python objects, ~90 MiB for a 49k-token vocabulary, which a process then keeps as heap)
and, through engine/hub/gguf_header.py, for a file on the Hub read over HTTP range requests (its
shapes before any download: a GGUF repo rarely has a config.json). Reads go through
`fetch(start, end_inclusive) -> bytes` a megabyte at a time. Plain parsing, no engine imports:
engine.model.configs builds the config transformers would from it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's order: dims[0] is the fastest (a matrix's columns)
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, Any]  # metadata key -> value (the token list only as its length)
    tensor_types: dict[str, int]  # tensor name -> GGML type id
    params: int  # elements over all tensors, the model's parameter count
    tensors: tuple[TensorInfo, ...] = ()
    data_start: int = 0  # where the data section begins in the file

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
    tensors: list[TensorInfo] = []
    params = 0
    for _ in range(n_tensors):
        name = s.string()
        dims = tuple(s.unpack("<Q") for _ in range(s.unpack("<I")))
        count = 1
        for dim in dims:
            count *= dim
        params += count
        types[name] = s.unpack("<I")
        tensors.append(TensorInfo(name, dims, types[name], s.unpack("<Q")))
    alignment = fields.get("general.alignment", 32)
    alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
    data_start = -(-s.pos // alignment) * alignment
    return GGUFHeader(fields, types, params, tuple(tensors), data_start)


def skipped_count(value: Any) -> int | None:
    """The length of an array the header walked over without keeping (the token list)."""
    return value.count if isinstance(value, _Skipped) else None


def kept(value: Any) -> Any:
    """A metadata value, None for one walked over without keeping."""
    return None if isinstance(value, _Skipped) else value


def local_header(path: Path) -> GGUFHeader:
    """The header of a GGUF file on this machine (GGUFHeaderError if it is not one, or ends
    inside its header)."""
    with open(path, "rb") as f:

        def fetch(start: int, end: int) -> bytes:
            f.seek(start)
            return f.read(end - start + 1)

        return read_header(fetch)
