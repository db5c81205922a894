"""Engine events to JSON and back, for `GET /v1/kvscope/events`.

The wire form of an event is `{"type": "<class name>", "data": {field: value}}` with nested
dataclasses as plain objects and tuples as arrays. Decoding is driven by the dataclasses' own
type hints, so the app rebuilds the very objects the engine made (`decode(encode(e)) == e`) and
folds them into its live state exactly as it folds a local engine's. A type or field this side
does not know (a newer server) is skipped, a missing field takes its default (an older one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine import events as _events

# Every dataclass in engine.events (the events and what they carry) and the model shapes.
_TYPES: dict[str, type] = {
    name: value
    for name, value in vars(_events).items()
    if isinstance(value, type) and dataclasses.is_dataclass(value)
}


@dataclass(frozen=True, slots=True)
class RequestTagged:
    """Serve-only record on the events stream, just before the engine's RequestStarted: the
    request id the engine gave to a client's tagged request (how an attached app finds its own
    requests among everyone's)."""

    request_id: int
    tag: str
    t: float = 0.0


_TYPES["RequestTagged"] = RequestTagged


class DecodeError(ValueError):
    """A wire object that cannot become an event; the message says what was wrong."""


def to_wire(event: object) -> dict[str, Any]:
    return {"type": type(event).__name__, "data": _plain(event)}


def encode(events: Iterable[object]) -> str:
    """A JSON array of events. Floats keep their exact value (JSON's shortest repr round-trips
    a double); infinities use Python's `Infinity`, which `decode` reads back."""
    return json.dumps([to_wire(e) for e in events], separators=(",", ":"))


def _plain(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def decode(text: str) -> list[Any]:
    """Events from a JSON array made by `encode`; unknown types are left out."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}") from exc
    if not isinstance(items, list):
        raise DecodeError("expected a JSON array of events")
    out: list[Any] = []
    for item in items:
        event = from_wire(item)
        if event is not None:
            out.append(event)
    return out


def from_wire(item: object) -> Any | None:
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        raise DecodeError(f"an event must be an object with a type, got {item!r:.80}")
    cls = _TYPES.get(item["type"])
    if cls is None:
        return None  # an event type newer than this client
    return _build(cls, item.get("data") or {})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(_events) | _TYPES)


def _build(cls: type, data: object) -> Any:
    if not isinstance(data, dict):
        raise DecodeError(f"{cls.__name__} must be an object, got {data!r:.80}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _value(hints[f.name], data[f.name])
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field missing
        raise DecodeError(f"{cls.__name__}: {exc}") from exc


def _value(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        for option in options:  # a dataclass option wants an object; plain ones take anything
            if isinstance(option, type) and dataclasses.is_dataclass(option) and isinstance(value, dict):
                return _build(option, value)
        plain = [o for o in options if not dataclasses.is_dataclass(o)]
        return _value(plain[0], value) if len(plain) == 1 else value
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v) for v in value)
        return tuple(_value(a, v) for a, v in zip(args, value))
    if origin is dict:
        return dict(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if hint is float and isinstance(value, int):
        return float(value)
    return value
