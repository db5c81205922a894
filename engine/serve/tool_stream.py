"""One choice's streamed reply split into content and OpenAI's `tool_calls` deltas.

Text before the format's call marker streams as content (a tail that could be the start of the
marker is held back). After the marker:
- a reply held to the call format by a grammar (tool_choice required or named) is valid JSON by
  construction, so each call streams as it is written: its id and name once the name is
  complete, then its arguments as they grow;
- a free reply (tool_choice auto) may write a call that does not parse, and a streamed delta
  cannot be taken back: its calls are sent when the engine has read the whole reply
  (ToolCallsParsed), and a call that does not parse goes out as the content it was, with the
  parse error beside it. Nothing the model wrote is lost either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.events import ToolCall, ToolCallsParsed
from engine.tools.formats import LLAMA3_JSON, MISTRAL, ToolFormat, new_call_id

_NAME = re.compile(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(slots=True)
class StreamedCall:
    index: int
    id: str
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class Deltas:
    """What one push released: content text, and per call index its new fields."""

    content: str = ""
    calls: list[dict[str, object]] = field(default_factory=list)

    def call(self, index: int, **fields: object) -> None:
        self.calls.append({"index": index, **fields})


class ToolStream:
    def __init__(self, fmt: ToolFormat, incremental: bool):
        self.format = fmt
        self.incremental = incremental
        self.content = ""  # content streamed so far
        self.calls: list[StreamedCall] = []
        self.error = ""
        self._held = ""  # content not yet released (could begin the marker)
        self._in_calls = False
        self._body = ""  # text after the marker
        self._seen = False  # any non-space content seen (Llama 3's calls are the whole reply)

    # ---- streaming -------------------------------------------------------------------------
    def push(self, piece: str) -> Deltas:
        out = Deltas()
        if self._in_calls:
            self._body += piece
        else:
            self._held += piece
            self._find_marker(out)
        if self._in_calls and self.incremental:
            self._scan(out)
        return out

    def _find_marker(self, out: Deltas) -> None:
        marker = self.format.start_marker
        if self.format.name == LLAMA3_JSON:
            stripped = self._held.lstrip()
            if not stripped:
                return
            if not self._seen and (stripped.startswith("{") or stripped.startswith("<|python_tag|>")):
                self._in_calls, self._body, self._held = True, stripped.removeprefix("<|python_tag|>"), ""
                return
            self._seen = True
            out.content += self._release(len(self._held))
            return
        at = self._held.find(marker)
        if at >= 0:
            out.content += self._release(at)
            self._in_calls, self._body, self._held = True, self._held[len(marker) :], ""
            return
        keep = next(
            (
                k
                for k in range(min(len(marker) - 1, len(self._held)), 0, -1)
                if self._held.endswith(marker[:k])
            ),
            0,
        )
        out.content += self._release(len(self._held) - keep)

    def _release(self, upto: int) -> str:
        text, self._held = self._held[:upto], self._held[upto:]
        self.content += text
        return text

    def _scan(self, out: Deltas) -> None:
        """Every call object in the body so far: new names and argument text."""
        base = 1 if self.format.name == MISTRAL else 0  # Mistral's calls sit inside one array
        for index, (start, end, closed) in enumerate(_objects(self._body, base)):
            if index == len(self.calls):
                self.calls.append(StreamedCall(index, new_call_id()))
            call = self.calls[index]
            text = self._body[start:end]
            if not call.name:
                match = _NAME.match(text)
                if match is None:
                    continue
                call.name = match.group(1)
                out.call(index, id=call.id, type="function", function={"name": call.name, "arguments": ""})
            match = _NAME.match(text)
            assert match is not None
            value = text[match.end() :]
            if closed:
                value = value.rstrip()[:-1].rstrip()  # the object's own closing brace
            if len(value) > len(call.arguments):
                out.call(index, function={"arguments": value[len(call.arguments) :]})
                call.arguments = value

    # ---- the end ---------------------------------------------------------------------------
    def finish(self, parsed: ToolCallsParsed | None) -> Deltas:
        """The reply ended: what is still held goes out, with the engine's reading of the calls."""
        out = Deltas()
        if not self._in_calls:
            out.content += self._release(len(self._held))
            return out
        if parsed is not None and parsed.error:
            self.error = parsed.error
        if parsed is None or parsed.error or not parsed.calls:
            # Not a call after all (or one that does not parse): the text goes out as it was.
            raw = self.format.start_marker + self._body if self.format.name != LLAMA3_JSON else self._body
            if not self.calls:
                out.content += raw
                self.content += raw
            return out
        if not self.incremental or len(self.calls) < len(parsed.calls):
            for index, call in enumerate(parsed.calls[len(self.calls) :], start=len(self.calls)):
                self.calls.append(StreamedCall(index, call.id, call.name, call.arguments))
                out.call(index, id=call.id, type="function", function={"name": call.name, "arguments": ""})
                out.call(index, function={"arguments": call.arguments})
        else:
            # The streamed text of each call's arguments, as the engine read them (normalised).
            for streamed, final in zip(self.calls, parsed.calls):
                streamed.arguments = final.arguments
        return out

    def final_calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(c.name, c.arguments, c.id) for c in self.calls if c.name)


def _objects(text: str, base: int) -> list[tuple[int, int, bool]]:
    """(start, end, closed) of each JSON object opened at nesting depth `base` (end: past its
    closing brace, or the text's end while it is open)."""
    spans: list[tuple[int, int, bool]] = []
    depth, in_string, escaped, start = 0, False, False, -1
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            if ch == "{" and depth == base:
                start = i
            depth += 1
        elif ch in "}]":
            depth -= 1
            if ch == "}" and depth == base and start >= 0:
                spans.append((start, i + 1, True))
                start = -1
    if start >= 0:
        spans.append((start, len(text), False))
    return spans
